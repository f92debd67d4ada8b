"""Code bundles through the real API: stored content-addressed and read-only, every bad
archive refused with its reason and nothing left on disk; the code spec checked without
importing anything; and who may upload and submit code."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

from service.client import codepack
from service.database.db import Database
from service.settings import Settings
from tests.conftest import Api, Team

TRAIN_PY = (
    b"def build(args):\n    return {}\n\n\nclass Helper:\n    def build(self):\n        pass\n"
)


def tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buffer.getvalue()


def tar_with(info: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        ok = tarfile.TarInfo("pkg/ok.py")
        ok.size = 3
        tar.addfile(ok, io.BytesIO(b"x=1"))
        tar.addfile(info, io.BytesIO(data) if data else None)
    return buffer.getvalue()


def upload(api: Api, data: bytes, name: str = "code.tar.gz") -> Any:
    return api.post("/v1/code", files={"file": (name, data, "application/octet-stream")})


def code_dir(settings: Settings) -> Path:
    return settings.resolved_code_dir()


def leftovers(settings: Settings) -> list[str]:
    root = code_dir(settings)
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.fixture
def admin(api: Api, team: Team) -> Api:
    return api.as_user(team.admin)


BUNDLE = {"pkg/__init__.py": b"", "pkg/train.py": TRAIN_PY, "README": b"hello"}


def test_upload_stores_once_content_addressed_and_read_only(admin: Api, settings: Settings) -> None:
    r = upload(admin, tar_gz(BUNDLE))
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["digest"].startswith("sha256:") and len(body["digest"]) == 71
    assert body["files"] == 3
    assert body["bytes"] == sum(len(v) for v in BUNDLE.values())
    # The same files as a zip (another archive, the same content) are the same bundle: 200.
    again = upload(admin, zip_bytes(BUNDLE), "code.zip")
    assert again.status_code == 200, again.text
    assert again.json() == body
    # Without HALFWAY_STORAGE_URL the code directory is both the store (the bundle's tar)
    # and this host's cache (its unpacked tree).
    hexdigest = body["digest"].removeprefix("sha256:")
    assert leftovers(settings) == [hexdigest, f"sha256-{hexdigest}.tar"]
    root = code_dir(settings) / body["digest"].removeprefix("sha256:")
    assert (root / "pkg" / "train.py").read_bytes() == TRAIN_PY
    for path in [root, root / "pkg", root / "pkg" / "train.py"]:
        assert not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH), path
    listing = admin.get(f"/v1/code/{body['digest']}")
    assert listing.status_code == 200, listing.text
    assert listing.json()["listing"] == [
        {"path": "README", "bytes": 5},
        {"path": "pkg/__init__.py", "bytes": 0},
        {"path": "pkg/train.py", "bytes": len(TRAIN_PY)},
    ]
    # A changed file is another bundle.
    other = upload(admin, tar_gz({**BUNDLE, "README": b"hello!"}))
    assert other.status_code == 201 and other.json()["digest"] != body["digest"]


def test_unknown_and_malformed_digests(admin: Api) -> None:
    assert admin.get(f"/v1/code/sha256:{'0' * 64}").status_code == 404
    r = admin.get("/v1/code/sha256:xyz")
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "path.digest"


def _device() -> tarfile.TarInfo:
    info = tarfile.TarInfo("pkg/null")
    info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
    return info


def _link(kind: bytes, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo("pkg/link.py")
    info.type, info.linkname = kind, target
    return info


def _fifo() -> tarfile.TarInfo:
    info = tarfile.TarInfo("pkg/fifo")
    info.type = tarfile.FIFOTYPE
    return info


def _zip_symlink() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("pkg/ok.py", "x = 1")
        info = zipfile.ZipInfo("pkg/evil.py")
        info.create_system = 3
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
    return buffer.getvalue()


BAD_ARCHIVES: dict[str, tuple[bytes, str]] = {
    "dotdot_tar": (tar_gz({"pkg/ok.py": b"", "../escape.py": b"x"}), "path_escape"),
    "dotdot_zip": (zip_bytes({"pkg/../../escape.py": b"x"}), "path_escape"),
    "absolute_tar": (tar_gz({"/tmp/abs.py": b"x"}), "absolute_path"),
    "absolute_zip": (zip_bytes({"/etc/abs.py": b"x"}), "absolute_path"),
    "symlink_tar": (tar_with(_link(tarfile.SYMTYPE, "/etc/passwd")), "link"),
    "hardlink_tar": (tar_with(_link(tarfile.LNKTYPE, "pkg/ok.py")), "link"),
    "symlink_zip": (_zip_symlink(), "link"),
    "device_tar": (tar_with(_device()), "special_file"),
    "fifo_tar": (tar_with(_fifo()), "special_file"),
    "not_an_archive": (b"print('hello')\n" * 10, "not_an_archive"),
    "file_then_folder": (tar_gz({"pkg": b"x", "pkg/a.py": b"y"}), "duplicate"),
    "twice": (tar_gz({"pkg/a.py": b"x", "./pkg/a.py": b"y"}), "duplicate"),
    "empty_tar": (tar_gz({}), "empty"),
    "empty_zip": (zip_bytes({}), "empty"),
    "gzip_of_text": (__import__("gzip").compress(b"just text, not a tar" * 50), "not_an_archive"),
    "truncated_tar": (tar_gz({"pkg/a.py": os.urandom(50_000)})[:5_000], "not_an_archive"),
}


@pytest.mark.parametrize("kind", sorted(BAD_ARCHIVES))
def test_bad_archive_is_refused_with_its_reason_and_leaves_nothing(
    admin: Api, settings: Settings, kind: str
) -> None:
    data, rule = BAD_ARCHIVES[kind]
    r = upload(admin, data)
    assert r.status_code == 422, r.text
    assert r.json()["fields"] == [
        {"field": "file", "rule": rule, "message": r.json()["fields"][0]["message"]}
    ]
    assert leftovers(settings) == []
    assert not (Path("/tmp") / "abs.py").exists()


def test_limits_on_files_bytes_and_ratio(admin: Api, settings: Settings) -> None:
    settings.max_code_files = 3
    r = upload(admin, tar_gz({f"m{i}.py": b"x" for i in range(4)}))
    assert r.status_code == 422 and r.json()["fields"][0]["rule"] == "too_many_files", r.text
    assert "HALFWAY_MAX_CODE_FILES" in r.json()["message"]
    settings.max_code_files = 100
    settings.max_code_bytes = 100_000
    r = upload(admin, tar_gz({"big.bin": os.urandom(150_000)}))
    assert r.status_code in (413, 422), r.text
    settings.max_code_bytes = 200_000
    r = upload(admin, zip_bytes({"a.bin": os.urandom(120_000), "b.bin": os.urandom(120_000)}))
    assert r.status_code == 422 and r.json()["fields"][0]["rule"] == "too_large", r.text
    assert "HALFWAY_MAX_CODE_BYTES" in r.json()["message"]
    settings.max_code_bytes = 50 * 2**20
    # 4 MB of zeros compress to a few KB: refused as a bomb, as it inflates.
    for bomb in (tar_gz({"zeros.bin": bytes(4 << 20)}), zip_bytes({"zeros.bin": bytes(4 << 20)})):
        r = upload(admin, bomb)
        assert r.status_code == 422 and r.json()["fields"][0]["rule"] == "compression_bomb", r.text
    assert leftovers(settings) == []


def test_the_body_limit_refuses_an_archive_before_it_is_read(
    admin: Api, settings: Settings
) -> None:
    # The app's body limit is fixed when it is built: HALFWAY_MAX_CODE_BYTES + the envelope.
    r = upload(admin, os.urandom(settings.max_code_bytes + 100_000))
    assert r.status_code == 413, r.text
    assert leftovers(settings) == []


# --------------------------------------------------------------------------------------------
# The spec


def code_spec(digest: str, entrypoint: str = "pkg.train:build", **more: Any) -> dict[str, Any]:
    return {"code": {"bundle": digest, "entrypoint": entrypoint, "args": {"n": 1}}, **more}


@pytest.fixture
def digest(admin: Api) -> str:
    r = upload(admin, tar_gz(BUNDLE))
    assert r.status_code == 201, r.text
    value: str = r.json()["digest"]
    return value


def test_code_job_dry_run_and_submission(admin: Api, digest: str) -> None:
    r = admin.post("/v1/jobs?dry_run=true", json=code_spec(digest))
    assert r.status_code == 200, r.text
    spec = r.json()["spec"]
    assert spec["code"] == {"bundle": digest, "entrypoint": "pkg.train:build", "args": {"n": 1}}
    assert "model" not in spec and "data" not in spec
    assert spec["name"] == "build-mixed_float16"
    r = admin.post("/v1/jobs", json=code_spec(digest))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["code"]["entrypoint"] == "pkg.train:build"
    assert "model" not in r.json()["spec"]


@pytest.mark.parametrize(
    ("body", "field", "rule"),
    [
        ({"model": {"kind": "mlp"}}, ["model"], "not_with_code"),
        (
            {"model": {"kind": "mlp"}, "data": {"kind": "synthetic"}},
            ["model", "data"],
            "not_with_code",
        ),
        ({"entrypoint": "pkg.missing:build"}, ["code.entrypoint"], "module_not_found"),
        ({"entrypoint": "pkg.train:train"}, ["code.entrypoint"], "function_not_found"),
        # A method of that name is not a top-level function.
        ({"entrypoint": "pkg.train:Helper"}, ["code.entrypoint"], "function_not_found"),
        ({"entrypoint": "nope.train:build"}, ["code.entrypoint"], "module_not_found"),
        ({"entrypoint": "pkg.train"}, ["code.entrypoint"], "string_pattern_mismatch"),
        ({"entrypoint": "pkg/train:build"}, ["code.entrypoint"], "string_pattern_mismatch"),
        ({"bundle": "sha256:" + "1" * 64}, ["code.bundle"], "not_found"),
        ({"bundle": "md5:abc"}, ["code.bundle"], "string_pattern_mismatch"),
        ({"args": {"blob": "x" * 70_000}}, ["code.args"], "too_large"),
        ({"args": [1, 2]}, ["code.args"], "dict_type"),
    ],
)
def test_bad_code_spec_is_a_422_naming_the_field(
    admin: Api, digest: str, body: dict[str, Any], field: list[str], rule: str
) -> None:
    body = dict(body)  # the parameter is shared by both databases
    spec = code_spec(digest)
    for key in ("entrypoint", "bundle", "args"):
        if key in body:
            spec["code"][key] = body.pop(key)
    spec.update(body)
    for dry in ("true", "false"):
        r = admin.post(f"/v1/jobs?dry_run={dry}", json=spec)
        assert r.status_code == 422, r.text
        fields = r.json()["fields"]
        assert [f["field"] for f in fields] == field, fields
        assert {f["rule"] for f in fields} == {rule}, fields
    assert admin.get("/v1/jobs").json()["items"] == []


def test_a_module_that_does_not_parse_is_named_with_its_line(admin: Api) -> None:
    r = upload(admin, tar_gz({"pkg/__init__.py": b"", "pkg/train.py": b"def build(args:\n"}))
    spec = code_spec(r.json()["digest"])
    r = admin.post("/v1/jobs?dry_run=true", json=spec)
    assert r.status_code == 422, r.text
    assert r.json()["fields"][0]["rule"] == "syntax_error"
    assert "pkg/train.py:1" in r.json()["message"]


# --------------------------------------------------------------------------------------------
# Who may run code


def _grant(db: Database, name: str) -> None:
    from service.people import grants

    with db.write() as session:
        grants.grant(session, name, "code")


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # who: admin, member (alice), granted member (bob)
        ("admins", {"admin": True, "alice": False, "bob": True}),
        ("members", {"admin": True, "alice": True, "bob": True}),
        ("off", {"admin": False, "alice": False, "bob": False}),
    ],
)
def test_permission_table_for_upload_and_submission(
    api: Api, team: Team, db: Database, settings: Settings, policy: str, expected: dict[str, bool]
) -> None:
    settings.code_jobs = "members"
    digest = upload(api.as_user(team.admin), tar_gz(BUNDLE)).json()["digest"]
    _grant(db, "bob")
    settings.code_jobs = policy  # type: ignore[assignment]
    tokens = {"admin": team.admin, "alice": team.alice, "bob": team.bob}
    for who, allowed in expected.items():
        user = api.as_user(tokens[who])
        up = upload(user, tar_gz({**BUNDLE, "who": who.encode()}))
        dry = user.post("/v1/jobs?dry_run=true", json=code_spec(digest))
        sub = user.post("/v1/jobs", json=code_spec(digest))
        sweep = user.post("/v1/sweeps", json={"base": code_spec(digest), "policies": ["float32"]})
        codes = [up.status_code, dry.status_code, sub.status_code, sweep.status_code]
        assert codes == ([201, 200, 201, 201] if allowed else [403] * 4), (who, codes, sub.text)
        if not allowed:
            assert "HALFWAY_CODE_JOBS" in sub.json()["message"]
        # A plain job needs no right.
        assert user.post("/v1/jobs?dry_run=true", json={}).status_code == 200


def test_users_cli_grants_and_revokes_code(
    tmp_path: Path, settings: Settings, db: Database
) -> None:
    env = {
        **os.environ,
        "HALFWAY_DATABASE_URL": settings.resolved_database_url(),
        "HALFWAY_HOME": str(tmp_path / "cli-home"),
    }
    halfway = [sys.executable, "-m", "service.cli", "users"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*halfway, *args], env=env, capture_output=True, text=True, timeout=60
        )

    from service.people import grants

    def holds(name: str) -> bool:
        with db.read() as session:
            return grants.has_grant(session, name, "code")

    assert run("add", "carol", "--code").returncode == 0
    assert run("add", "dave").returncode == 0
    assert holds("carol") and not holds("dave")
    r = run("grant", "dave", "code")
    assert r.returncode == 0 and "dave may run code" in r.stdout
    assert holds("dave")
    r = run("revoke", "carol", "code")
    assert r.returncode == 0 and holds("dave") and not holds("carol")
    r = run("grant", "nobody", "code")
    assert r.returncode == 1 and "no user 'nobody'" in r.stderr
    assert run("grant", "dave", "sudo").returncode == 2


def test_pack_skips_vcs_caches_venvs_and_ignored(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    for rel in [
        "pkg/__init__.py",
        "pkg/train.py",
        ".git/HEAD",
        "pkg/__pycache__/x.pyc",
        "venv/lib/site.py",
        "data/big.bin",
        "notes.tmp",
        "keep/data.txt",
    ]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    (root / "venv" / "pyvenv.cfg").write_text("home = /usr")
    (root / ".halfwayignore").write_text("# comment\ndata/\n*.tmp\n")
    (root / "pkg" / "link.py").symlink_to(root / "pkg" / "train.py")
    assert codepack.files(root) == ["keep/data.txt", "pkg/__init__.py", "pkg/train.py"]
    # Packed twice, byte for byte the same archive (fixed metadata).
    assert codepack.pack(root) == codepack.pack(root)
    with tarfile.open(fileobj=io.BytesIO(codepack.pack(root))) as tar:
        assert sorted(tar.getnames()) == codepack.files(root)
    assert json.dumps(codepack.files(root))


def test_code_modules_of_the_api_import_no_tensorflow() -> None:
    code = (
        "import sys\n"
        "import service.files.code, service.people.grants\n"
        "import service.client.codepack, service.client.code_commands\n"
        "import service.api.routes.code, workers.supervisor\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_push_through_the_cli(live: Any, tmp_path: Path) -> None:
    from tests.live import halfway

    root = tmp_path / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "train.py").write_text(TRAIN_PY.decode())
    admin = {"HALFWAY_TOKEN": live.team.admin}
    first = halfway(live, "code", "push", str(root), env=admin)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "(2 files," in first.stdout and "uploaded" in first.stdout
    digest = first.stdout.split()[2]
    assert digest.startswith("sha256:")
    again = halfway(live, "code", "push", str(root), env=admin)
    assert again.returncode == 0 and "already on the server" in again.stdout
    assert again.stdout.split()[2] == digest
    # Alice is a member and the default is HALFWAY_CODE_JOBS=admins: 403, exit code 5.
    refused = halfway(live, "code", "push", str(root))
    assert refused.returncode == 5, refused.stdout + refused.stderr
    assert "HALFWAY_CODE_JOBS" in refused.stdout + refused.stderr
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"training": {"epochs": 1}}))
    no_section = halfway(live, "submit", str(spec), "--code", str(root), env=admin)
    assert no_section.returncode == 2 and "needs a 'code' section" in no_section.stderr
    spec.write_text(json.dumps({"code": {"entrypoint": "pkg.train:build"}}))
    dry = halfway(live, "submit", str(spec), "--code", str(root), "--dry-run", env=admin)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert digest in dry.stdout and "The spec is valid" in dry.stdout
