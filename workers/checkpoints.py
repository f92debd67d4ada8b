"""Where a job's checkpoints live in the store, how one is committed, and the supervisor's
housekeeping of them. No TensorFlow: the supervisor prunes what the training child wrote.

A checkpoint is two objects under the job's prefix: its data (``checkpoint-<step>.npz``) and,
written only once the data is whole, its commit marker (``checkpoint-<step>.npz.commit``,
with the data's size and SHA-256). A checkpoint without its marker does not exist: an upload
cut short by a dead host is never resumed from, and a marker's digest catches data that is not
what was committed.

A job resumes only from the checkpoint the supervisor acknowledged, i.e. committed to the
database together with every history row before it; the child may already have committed
newer ones, which are kept until a newer acknowledgement supersedes the old."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import IO, Any

from service.files.storage import Store

_NAME = re.compile(r"^checkpoint-(\d{12})\.npz(\.part|\.commit)?$")
MARKER = ".commit"


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"checkpoint-{step:012d}.npz"


def data_key(prefix: str, step: int) -> str:
    return f"{prefix}/checkpoint-{step:012d}.npz"


def marker_key(prefix: str, step: int) -> str:
    return data_key(prefix, step) + MARKER


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        reader = _Hashing(f)
        while reader.read(1 << 20):
            pass
        return reader.digest.hexdigest()


class _Hashing(io.RawIOBase):
    """A reader that hashes and counts what passes through it, so a checkpoint is read once
    while it is uploaded and its marker describes exactly the bytes the store got."""

    def __init__(self, source: IO[bytes]) -> None:
        self.source, self.digest, self.size = source, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.source.read(len(buffer))
        buffer[: len(data)] = data
        self.digest.update(data)
        self.size += len(data)
        return len(data)


def commit(store: Store, prefix: str, step: int, source: IO[bytes]) -> None:
    """Upload the checkpoint's data, then its marker: the one write that makes it visible.
    The marker describes the bytes uploaded, so data changed afterwards by whoever wrote the
    file (or in the store) is caught on fetch."""
    reader = _Hashing(source)
    store.put_stream(data_key(prefix, step), io.BufferedReader(reader, 1 << 20))
    marker = {"step": step, "bytes": reader.size, "sha256": reader.digest.hexdigest()}
    store.put_bytes(marker_key(prefix, step), json.dumps(marker).encode())


def fetch(store: Store, prefix: str, step: int, scratch: Path) -> Path | None:
    """The committed checkpoint of ``step`` as a local file (downloaded into ``scratch`` from
    a remote store), or None when there is none or its data is not what was committed."""
    raw = store.get_bytes(marker_key(prefix, step))
    if raw is None:
        return None
    marker = json.loads(raw)
    key = data_key(prefix, step)
    local = store.local_path(key)
    if local is None:
        local = checkpoint_path(scratch, step)
        if not store.get_file(key, local):
            return None
    if not local.is_file() or local.stat().st_size != marker["bytes"]:
        return None
    if sha256(local) != marker["sha256"]:
        return None
    return local


def _steps(store: Store, prefix: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for entry in store.list(prefix + "/"):
        match = _NAME.match(entry.key[len(prefix) + 1 :])
        if match:
            found.setdefault(int(match.group(1)), []).append(entry.key)
    return found


def committed_steps(store: Store, prefix: str) -> list[int]:
    return sorted(
        step
        for step, keys in _steps(store, prefix).items()
        if any(k.endswith(MARKER) for k in keys)
    )


def _delete(store: Store, keys: list[str]) -> None:
    # The marker first: a checkpoint is never visible without its data.
    for key in sorted(keys, key=lambda k: not k.endswith(MARKER)):
        store.delete(key)


def prune(store: Store, prefix: str, acknowledged: int) -> None:
    """Delete the checkpoints older than the acknowledged one (it and newer ones stay)."""
    for step, keys in _steps(store, prefix).items():
        if step < acknowledged:
            _delete(store, keys)


def remove_all(store: Store, prefix: str) -> None:
    """A job that has ended for good needs no checkpoint (they are as large as the model and
    its optimizer state)."""
    for keys in _steps(store, prefix).values():
        _delete(store, keys)
