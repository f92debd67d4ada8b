"""Code bundles in the object store, on each store (a ``file://`` URL and a real S3 API): an
upload is one object in the store, listed and checked from there by an API host that never
saw the upload; a code job trains on a worker whose HALFWAY_HOME is not the API's (nothing
shared but the database and the store); an object changed in the store fails its job naming
the digest mismatch; and a store that fails during an upload is a 503 that leaves nothing."""

from __future__ import annotations

import io
import tarfile
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.client import codepack
from service.database.db import Database
from service.errors import NotFound
from service.files import codestore
from service.files.code import tree_digest
from service.files.storage import Storage, Store, open_storage, s3_client
from service.settings import Settings
from tests.conftest import Api, Team
from tests.s3 import S3Server
from tests.test_training_keras import all_history
from workers.supervisor import Supervisor

MODEL_PY = """\
import numpy as np
import keras


class Scale(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


def build(args):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    layers = [keras.Input((4,)), Scale(), keras.layers.Dense(2, activation="softmax")]
    return {"model": keras.Sequential(layers), "train": (x, y)}
"""
FILES = {"tiny/__init__.py": "", "tiny/model.py": MODEL_PY, "README": "a tiny bundle\n"}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def spec(digest: str) -> dict[str, Any]:
    return {
        "code": {"bundle": digest, "entrypoint": "tiny.model:build"},
        "training": {"epochs": 2, "batch_size": 32},
        "outputs": {"save_model": False},
    }


def upload(api: Api, tree: Path) -> Any:
    return api.post("/v1/code", files={"file": ("b.tar.gz", codepack.pack(tree))})


def untar(data: bytes) -> dict[str, str]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar:
            source = tar.extractfile(member)
            assert source is not None
            out[member.name] = source.read().decode()
    return out


def cache_entries(settings: Settings) -> list[str]:
    root = settings.resolved_code_dir()
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.fixture
def shared(storage_kind: str, settings: Settings, tmp_path: Path, request: Any) -> Settings:
    """The API host's settings on a store a second host can reach: a ``file://`` URL outside
    both homes, or a fresh bucket."""
    if storage_kind == "file":
        url = (tmp_path / "store").as_uri()
        return settings.model_copy(update={"storage_url": url})
    server: S3Server = request.getfixturevalue("s3_server")
    return settings.model_copy(
        update={
            "storage_url": f"s3://{server.new_bucket()}/team",
            "s3_endpoint_url": server.endpoint,
        }
    )


def other_host(settings: Settings, tmp_path: Path, name: str) -> Settings:
    """The same database and store, and a home of its own: no path in common."""
    home = tmp_path / name
    other = settings.model_copy(update={"home": home})
    other.ensure_dirs()
    assert not other.resolved_code_dir().is_relative_to(settings.home)
    return other


@pytest.fixture
def admin(shared: Settings, db: Database, team: Team) -> Iterator[Api]:
    with TestClient(create_app(shared, db, auth=True)) as c:
        yield Api(c, team.admin)


def code_store(settings: Settings) -> Store:
    return open_storage(settings.storage_config()).code


def objects_seen_raw(settings: Settings, request: Any) -> dict[str, bytes]:
    """The code objects as the store itself holds them (the bucket through its own client,
    or the directory), not through Halfway's store classes."""
    assert settings.storage_url is not None
    if settings.storage_url.startswith("file://"):
        root = Path(settings.storage_url.removeprefix("file://")) / "code"
        return {p.name: p.read_bytes() for p in root.iterdir()} if root.exists() else {}
    server: S3Server = request.getfixturevalue("s3_server")
    bucket = settings.storage_url.removeprefix("s3://").split("/")[0]
    client = s3_client(server.endpoint, "us-east-1")
    listed = client.list_objects_v2(Bucket=bucket, Prefix="team/code/").get("Contents", [])
    return {
        o["Key"].removeprefix("team/code/"): client.get_object(Bucket=bucket, Key=o["Key"])[
            "Body"
        ].read()
        for o in listed
    }


def test_an_upload_is_one_object_in_the_store_that_another_api_host_lists_and_checks(
    admin: Api, shared: Settings, db: Database, team: Team, tmp_path: Path, request: Any
) -> None:
    tree = write_tree(tmp_path / "src", FILES)
    first = upload(admin, tree)
    assert first.status_code == 201, first.text
    digest = first.json()["digest"]
    hexdigest = digest.removeprefix("sha256:")
    stored = objects_seen_raw(shared, request)
    assert list(stored) == [f"sha256-{hexdigest}.tar"]
    assert untar(stored[f"sha256-{hexdigest}.tar"]) == FILES
    # Again, from a zip (other archive bytes, the same files): the same object, a 200.
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for rel, text in FILES.items():
            zf.writestr(rel, text)
    again = admin.post("/v1/code", files={"file": ("b.zip", buffer.getvalue())})
    assert again.status_code == 200, again.text
    assert again.json() == first.json()
    assert objects_seen_raw(shared, request) == stored

    # A second API host: its own home, the bundle never uploaded to it.
    second = other_host(shared, tmp_path, "api-b")
    with TestClient(create_app(second, db, auth=True)) as c:
        api_b = Api(c, team.admin)
        listing = api_b.get(f"/v1/code/{digest}")
        assert listing.status_code == 200, listing.text
        assert listing.json()["listing"] == [
            {"path": p, "bytes": len(FILES[p].encode())} for p in sorted(FILES)
        ]
        checked = api_b.post("/v1/jobs?dry_run=true", json=spec(digest))
        assert checked.status_code == 200, checked.text
        wrong = spec(digest)
        wrong["code"]["entrypoint"] = "tiny.model:missing"
        bad = api_b.post("/v1/jobs?dry_run=true", json=wrong)
        assert bad.status_code == 422 and bad.json()["fields"][0]["rule"] == "function_not_found"
    # It parsed the entry point in its own cache, fetched from the store.
    assert cache_entries(second) == [hexdigest]


@pytest.mark.keras
def test_a_code_job_trains_on_a_host_sharing_only_the_database_and_the_store(
    admin: Api, shared: Settings, db: Database, tmp_path: Path
) -> None:
    digest = upload(admin, write_tree(tmp_path / "src", FILES)).json()["digest"]
    hexdigest = digest.removeprefix("sha256:")
    worker = other_host(shared, tmp_path, "worker-b")
    first = admin.post("/v1/jobs", json=spec(digest)).json()["id"]
    assert Supervisor(db, worker).run_once()
    job = admin.get(f"/v1/jobs/{first}").json()
    assert job["status"] == "succeeded", (job, admin.get(f"/v1/jobs/{first}/logs").text)
    assert [r["step"] for r in all_history(admin, first)] == list(range(4))  # 64 / 32, 2 epochs
    log = admin.get(f"/v1/jobs/{first}/logs").text
    assert f"code bundle {digest} fetched from" in log
    # The worker's cache holds the checked tree, read-only, and nothing half-done.
    assert cache_entries(worker) == [hexdigest]
    cached = worker.resolved_code_dir() / hexdigest
    assert (cached / "tiny" / "model.py").read_text() == MODEL_PY
    assert not (cached / "tiny" / "model.py").stat().st_mode & 0o222

    # The next job of that bundle on this host runs from the cache: it would fail if it went
    # to the store, where the object is gone now.
    second = admin.post("/v1/jobs", json=spec(digest)).json()["id"]
    code_store(shared).delete(codestore.key_for(digest))
    assert Supervisor(db, worker).run_once()
    job = admin.get(f"/v1/jobs/{second}").json()
    assert job["status"] == "succeeded", job["error"]
    assert "fetched from" not in admin.get(f"/v1/jobs/{second}/logs").text


@pytest.mark.keras
def test_a_bundle_changed_in_the_store_fails_its_job_naming_the_digest_mismatch(
    admin: Api, shared: Settings, db: Database, tmp_path: Path
) -> None:
    digest = upload(admin, write_tree(tmp_path / "src", FILES)).json()["digest"]
    key = codestore.key_for(digest)
    store = code_store(shared)
    original = store.get_bytes(key)
    # Someone with write access to the bucket swaps the code under the same name.
    evil = write_tree(tmp_path / "evil", {**FILES, "tiny/model.py": MODEL_PY + "\nimport os\n"})
    codestore.pack(evil, tmp_path / "evil.tar")
    store.put_file(key, tmp_path / "evil.tar")
    # The API host still has the upload's tree in its cache, so the job is accepted.
    job_id = admin.post("/v1/jobs", json=spec(digest)).json()["id"]

    worker = other_host(shared, tmp_path, "worker-b")
    assert Supervisor(db, worker).run_once()
    job = admin.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "failed" and job["attempt"] == 1, job
    assert digest in job["error"] and "digest mismatch" in job["error"], job["error"]
    assert admin.get(f"/v1/jobs/{job_id}/history").json()["items"] == []
    assert cache_entries(worker) == []  # no tree, and no half-unpacked one

    # Uploading the bundle again writes the object afresh.
    assert upload(admin, write_tree(tmp_path / "src", FILES)).status_code == 200
    assert store.get_bytes(key) == original
    assert codestore.fetch(store, worker.resolved_code_dir(), digest).is_dir()


def _tar(members: dict[str, bytes], link: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo("tiny/link.py")
            info.type, info.linkname = tarfile.SYMTYPE, link
            tar.addfile(info)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("garbage", "is not a bundle Halfway wrote"),
        ("escape", "escapes the bundle root"),
        ("link", "is a link"),
        ("other_files", "digest mismatch"),
    ],
)
def test_a_fetch_refuses_an_object_that_is_not_the_bundle_and_caches_nothing(
    storage: Storage, tmp_path: Path, kind: str, says: str
) -> None:
    digest = "sha256:" + tree_digest(write_tree(tmp_path / "src", FILES))
    bodies = {
        "garbage": b"not a tar at all" * 100,
        "escape": _tar({"tiny/model.py": b"x", "../../outside.py": b"y"}),
        "link": _tar({"tiny/model.py": b"x"}, link="/etc/passwd"),
        "other_files": _tar({"tiny/model.py": b"x"}),
    }
    storage.code.put_bytes(codestore.key_for(digest), bodies[kind])
    cache = tmp_path / "cache"
    with pytest.raises(codestore.BundleCorrupt) as raised:
        codestore.fetch(storage.code, cache, digest)
    assert says in raised.value.message and digest in raised.value.message
    assert list(cache.iterdir()) == []
    assert not (tmp_path / "outside.py").exists()
    with pytest.raises(NotFound):
        codestore.fetch(storage.code, cache, "sha256:" + "0" * 64)


def test_a_store_that_fails_during_an_upload_is_a_503_and_leaves_nothing(
    settings: Settings, db: Database, team: Team, s3_server: S3Server, tmp_path: Path
) -> None:
    from tests.live import free_port

    tree = write_tree(tmp_path / "src", FILES)
    unreachable = settings.model_copy(
        update={
            "storage_url": "s3://nowhere/team",
            "s3_endpoint_url": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        }
    )
    # Reachable, but the bucket is not there yet: every PUT is refused, after the archive
    # was checked and unpacked.
    bucket = f"halfway-later-{uuid.uuid4().hex[:12]}"
    refusing = settings.model_copy(
        update={"storage_url": f"s3://{bucket}/team", "s3_endpoint_url": s3_server.endpoint}
    )
    for down in (unreachable, refusing):
        with TestClient(create_app(down, db, auth=True)) as c:
            r = upload(Api(c, team.admin), tree)
        assert r.status_code == 503, r.text
        assert r.json()["error"] == "storage_unavailable"
        assert cache_entries(down) == []  # no tree a job could be accepted for
    s3_client(s3_server.endpoint, "us-east-1").create_bucket(Bucket=bucket)
    with TestClient(create_app(refusing, db, auth=True)) as c:
        r = upload(Api(c, team.admin), tree)
    # Created now: the failed attempt left no object behind.
    assert r.status_code == 201, r.text
    assert code_store(refusing).exists(codestore.key_for(r.json()["digest"]))
