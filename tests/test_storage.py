"""The store behind HALFWAY_STORAGE_URL, on a local directory and on a real S3 API (moto's
server on loopback): objects, atomic checkpoint commits, their housekeeping, and a training
run that checkpoints into the store and resumes from it on a fresh scratch disk."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from service.files.storage import (
    AlreadyExists,
    FileStore,
    Storage,
    StorageConfig,
    StorageError,
    Store,
)
from service.files.storage import open_storage as open_store
from service.settings import Settings
from workers import checkpoints

# ---------------------------------------------------------------------------------------------
# Objects


def test_objects_round_trip_with_ranges_listing_and_deletes(
    storage: Storage, tmp_path: Path
) -> None:
    store = storage.artifacts
    source = tmp_path / "blob"
    payload = bytes(range(256)) * 5000  # over one read chunk
    source.write_bytes(payload)
    store.put_file("7/model.keras", source)
    store.put_bytes("7/train.log", b"line 1\nline 2\n")
    store.put_bytes("8/train.log", b"other job")

    assert store.size("7/model.keras") == len(payload)
    assert store.size("7/missing") is None
    assert store.read_range("7/model.keras", 1000, 10) == payload[1000:1010]
    assert b"".join(store.iter_bytes("7/model.keras", start=5, chunk=4096)) == payload[5:]
    assert store.get_bytes("7/train.log") == b"line 1\nline 2\n"
    got = tmp_path / "down" / "copy"
    assert store.get_file("7/model.keras", got) and got.read_bytes() == payload
    assert not store.get_file("7/nothing", tmp_path / "none")
    assert [(e.key, e.size) for e in store.list("7/")] == [
        ("7/model.keras", len(payload)),
        ("7/train.log", 14),
    ]
    store.delete("7/train.log")
    store.delete("7/train.log")  # a missing object is no error
    assert [e.key for e in store.list("7/")] == ["7/model.keras"]
    # The two namespaces of one URL do not see each other.
    assert storage.data.list() == []


def test_an_if_absent_write_never_replaces_an_object(storage: Storage) -> None:
    storage.data.put_bytes("uploads/alice/a.npz", b"first", if_absent=True)
    with pytest.raises(AlreadyExists):
        storage.data.put_bytes("uploads/alice/a.npz", b"second", if_absent=True)
    assert storage.data.get_bytes("uploads/alice/a.npz") == b"first"


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "./a", "a/\x00"])
def test_keys_that_could_leave_the_store_are_refused(storage: Storage, key: str) -> None:
    with pytest.raises(StorageError):
        storage.artifacts.put_bytes(key, b"x")


def test_a_reader_seeks_so_zipfile_reads_an_npz_without_the_whole_object(
    storage: Storage,
) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, x_train=np.zeros((300, 4), np.float32), y_train=np.arange(300))
    storage.data.put_bytes("d.npz", buffer.getvalue())
    with zipfile.ZipFile(storage.data.open_reader("d.npz")) as archive:
        assert sorted(archive.namelist()) == ["x_train.npy", "y_train.npy"]
        with archive.open("y_train.npy") as f:
            assert np.array_equal(np.load(f), np.arange(300))


def test_storage_urls_are_checked(tmp_path: Path) -> None:
    base = {
        "artifact_dir": str(tmp_path / "a"),
        "data_dir": str(tmp_path / "d"),
        "code_dir": str(tmp_path / "c"),
    }
    for url in ("ftp://x/y", "s3:///prefix", "file://otherhost/x"):
        with pytest.raises(StorageError):
            open_store(StorageConfig(url=url, **base))
    root = tmp_path / "root"
    storage = open_store(StorageConfig(url=root.as_uri(), **base))
    storage.artifacts.put_bytes("1/train.log", b"x")
    storage.data.put_bytes("d.npz", b"y")
    assert (root / "artifacts" / "1" / "train.log").read_bytes() == b"x"
    assert (root / "data" / "d.npz").read_bytes() == b"y"
    assert not storage.remote


def test_default_storage_is_todays_directories(settings: Settings) -> None:
    storage = open_store(settings.storage_config())
    storage.artifacts.put_bytes("3/train.log", b"x")
    assert (settings.resolved_artifact_dir() / "3" / "train.log").read_bytes() == b"x"
    assert storage.data.local_root() == settings.resolved_data_dir()


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _checkpoint(tmp_path: Path, step: int, content: bytes) -> Path:
    local = checkpoints.checkpoint_path(tmp_path, step)
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(content)
    return local


def _commit(store: Store, prefix: str, step: int, local: Path) -> None:
    with open(local, "rb") as f:
        checkpoints.commit(store, prefix, step, f)


def test_a_checkpoint_exists_only_once_its_marker_is_written(
    storage: Storage, tmp_path: Path
) -> None:
    store = storage.artifacts
    local = _checkpoint(tmp_path / "stage", 400, b"weights at 400")
    _commit(store, "5", 400, local)
    assert checkpoints.committed_steps(store, "5") == [400]
    fetched = checkpoints.fetch(store, "5", 400, tmp_path / "fresh")
    assert fetched is not None and fetched.read_bytes() == b"weights at 400"

    # An upload cut short by a dead host: the data is there, the marker never came.
    store.put_bytes(checkpoints.data_key("5", 600), b"weights at 6")
    assert checkpoints.committed_steps(store, "5") == [400]
    assert checkpoints.fetch(store, "5", 600, tmp_path / "fresh") is None


def test_a_checkpoint_whose_data_is_not_what_was_committed_is_not_resumed_from(
    storage: Storage, tmp_path: Path
) -> None:
    store = storage.artifacts
    _commit(store, "5", 400, _checkpoint(tmp_path / "stage", 400, b"weights at 400"))
    # Same size, other bytes (another writer, a bad disk): the digest in the marker catches it.
    store.put_bytes(checkpoints.data_key("5", 400), b"weights at 999")
    assert checkpoints.fetch(store, "5", 400, tmp_path / "fresh") is None
    marker = json.loads(store.get_bytes(checkpoints.marker_key("5", 400)) or b"")
    assert marker["bytes"] == 14 and marker["step"] == 400


def test_pruning_keeps_the_acknowledged_checkpoint_and_newer(
    storage: Storage, tmp_path: Path
) -> None:
    store = storage.artifacts
    for step in (100, 200, 300):
        _commit(store, "9", step, _checkpoint(tmp_path / "stage", step, b"x"))
    store.put_bytes(checkpoints.data_key("9", 50), b"half")  # never committed
    store.put_bytes("9/model.keras", b"keep")
    store.put_bytes("90/checkpoint-000000000001.npz", b"another job's")
    checkpoints.prune(store, "9", 200)
    assert checkpoints.committed_steps(store, "9") == [200, 300]
    assert [e.key for e in store.list("9/")] == [
        "9/checkpoint-000000000200.npz",
        "9/checkpoint-000000000200.npz.commit",
        "9/checkpoint-000000000300.npz",
        "9/checkpoint-000000000300.npz.commit",
        "9/model.keras",
    ]
    checkpoints.remove_all(store, "9")
    assert [e.key for e in store.list("9/")] == ["9/model.keras"]
    assert store.exists("90/checkpoint-000000000001.npz")


def test_a_committed_checkpoint_is_a_copy_its_writer_cannot_change(tmp_path: Path) -> None:
    """The training child writes into its scratch; what the store holds is a copy, so the
    child changing its file afterwards (or an orphaned attempt writing on) changes nothing
    a resume reads."""
    store = FileStore(tmp_path / "store")
    local = _checkpoint(tmp_path / "scratch", 10, b"w")
    _commit(store, "4", 10, local)
    local.write_bytes(b"changed after the commit")
    fetched = checkpoints.fetch(store, "4", 10, tmp_path / "elsewhere")
    assert fetched is not None and fetched.read_bytes() == b"w"
    assert not fetched.resolve().is_relative_to((tmp_path / "scratch").resolve())


def test_the_tensorboard_command_points_at_the_store_the_server_uses() -> None:
    from service.client.render import server_artifact_dir

    assert server_artifact_dir(None, {"HALFWAY_STORAGE_URL": "s3://team/ml/"}) == (
        "s3://team/ml/artifacts"
    )
    assert server_artifact_dir(None, {"HALFWAY_STORAGE_URL": "file:///srv/hw"}) == (
        "/srv/hw/artifacts"
    )
    assert server_artifact_dir("/given", {"HALFWAY_STORAGE_URL": "s3://team/ml"}) == "/given"
    assert server_artifact_dir(None, {"HALFWAY_HOME": "/h"}) == "/h/artifacts"


@pytest.mark.parametrize("url", ["ftp://host/x", "s3:///no-bucket", "file://host/x", "file:rel"])
def test_a_storage_url_halfway_cannot_open_is_refused_at_startup(url: str, tmp_path: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="storage_url"):
        Settings(home=tmp_path, storage_url=url)


def test_a_name_the_file_system_cannot_hold_is_simply_absent(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    assert store.size("a" * 5000 + ".npz") is None
    assert store.size("x/" * 3000 + "y") is None
