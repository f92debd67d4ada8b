"""A job's files, handled for the training child by whoever hosts it (the supervisor, or the
Ray actor on another node): the child holds no store credentials and sees no store. No
TensorFlow.

Before the child starts, ``stage`` brings in what it reads: the job's log so far, the
acknowledged checkpoint of a resumed attempt (checked against its commit marker), the
dataset (a local store's data folder as it is; a remote one's file downloaded once per host)
and the code bundle (fetched and verified against its digest). The child then writes only to
its scratch folder; ``JobFiles`` puts what it wrote into the store: a checkpoint when the
child says it has written one (``commit_checkpoint``), the log and TensorBoard files every
few seconds (``ship``), the saved model at the end (``publish``). The supervisor calls these
only while its lease holds, so an attempt that lost its job writes nothing anyone reads.

The scratch folder is the child's, so nothing in it is trusted: every file is opened
relative to the folder, one component at a time, without following a symbolic link, and only
regular files are read (a link to the server's database is refused, not copied).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from service.errors import NotFound
from service.files import code, codestore
from service.files.storage import Storage, StorageConfig, Store, check_key, open_storage
from workers import checkpoints
from workers.protocol import JobError

LOG = "train.log"
TENSORBOARD = "tensorboard"
SHIP_SECONDS = 2.0


class UnsafeOutput(Exception):
    """A name in the scratch folder that is not a regular file inside it."""


@contextlib.contextmanager
def open_inside(root: Path, name: str) -> Iterator[IO[bytes]]:
    """``root/name`` opened for reading, refusing a symbolic link anywhere below ``root`` and
    anything but a regular file (a FIFO would block, a device would leak)."""
    parts = Path(name).parts
    if not parts or any(p in ("", ".", "..") or "/" in p for p in parts):
        raise UnsafeOutput(f"{name!r} is not a plain relative name")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            leaf = os.open(parts[-1], flags, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise UnsafeOutput(f"{name} is a symbolic link") from None
            raise
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(leaf).st_mode):
        os.close(leaf)
        raise UnsafeOutput(f"{name} is not a regular file")
    os.set_blocking(leaf, True)
    with os.fdopen(leaf, "rb") as f:
        yield f


def regular_files(root: Path, folder: str) -> list[str]:
    """Names (relative to ``root``) of the regular files under ``root/folder``, not
    following links."""
    top = root / folder
    if top.is_symlink() or not top.is_dir():
        return []
    found = []
    for where, _dirs, names in os.walk(top):  # os.walk does not follow links to folders
        for n in names:
            path = Path(where) / n
            if not path.is_symlink() and path.is_file():
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


@dataclass
class Staged:
    """Where a staged attempt's folders are on this host."""

    scratch: Path  # the child's only writable folder
    data: Path  # the dataset folder, read-only to the child
    bundle: Path | None  # the code bundle's verified tree (code jobs)
    resume_step: int | None  # the acknowledged checkpoint, now in scratch; None: start over


class JobFiles:
    """One attempt's scratch folder and the job's place in the store."""

    def __init__(self, store: Store, prefix: str, scratch: Path) -> None:
        self.store, self.prefix, self.scratch = store, prefix, scratch
        self._shipped: dict[str, tuple[int, int]] = {}
        self._log_shipped = 0

    @staticmethod
    def for_attempt(storage: Storage, job_id: int, attempt: int, scratch_root: Path) -> JobFiles:
        # One folder per attempt: a killed attempt's leftovers never meet the next one's, and
        # they go now (whoever holds the lease holds the job: an earlier attempt is over).
        # Not newer ones: on a scratch disk that hosts share, a stale attempt can start
        # after a newer one took the job over, and the newer one's child is writing there.
        jobs = scratch_root / "jobs"
        for folder in jobs.glob(f"{job_id}-*"):
            number = folder.name.removeprefix(f"{job_id}-")
            if number.isdigit() and int(number) <= attempt:
                remove_tree(folder)
        scratch = jobs / f"{job_id}-{attempt}"
        scratch.mkdir(parents=True)
        (scratch / "tmp").mkdir()
        return JobFiles(storage.artifacts, str(job_id), scratch)

    def key(self, name: str) -> str:
        return check_key(f"{self.prefix}/{name}")

    # Before the child ---------------------------------------------------------------------

    def restore_log(self) -> None:
        """The attempt's log starts as the job's log so far (a later attempt appends)."""
        got = self.store.get_file(self.key(LOG), self.scratch / LOG)
        self._log_shipped = (self.scratch / LOG).stat().st_size if got else 0

    def restore_checkpoint(self, step: int) -> bool:
        """Copy the committed checkpoint of ``step`` into scratch (never a link into the
        store: the child could write through it). False when there is none, or its data is
        not what was committed."""
        fetched = checkpoints.fetch(self.store, self.prefix, step, self.scratch)
        if fetched is None:
            return False
        target = checkpoints.checkpoint_path(self.scratch, step)
        if fetched.resolve() != target.resolve():
            shutil.copyfile(fetched, target)
        return True

    # After the child wrote ----------------------------------------------------------------

    def commit_checkpoint(self, step: int) -> None:
        name = checkpoints.checkpoint_path(Path(), step).name
        with open_inside(self.scratch, name) as f:
            checkpoints.commit(self.store, self.prefix, step, f)
        (self.scratch / name).unlink(missing_ok=True)  # in the store now; scratch is no cache

    def publish(self, names: list[str]) -> None:
        """Upload the finished files the child saved (the model)."""
        for name in names:
            with open_inside(self.scratch, name) as f:
                self.store.put_stream(self.key(name), f)

    def ship(self) -> None:
        """Put the log's new lines and the TensorBoard files that changed into the store."""
        self._ship_log()
        for name in regular_files(self.scratch, TENSORBOARD):
            with (
                contextlib.suppress(FileNotFoundError, UnsafeOutput),
                open_inside(self.scratch, name) as f,
            ):
                st = os.fstat(f.fileno())
                seen = (st.st_size, st.st_mtime_ns)
                if self._shipped.get(name) != seen:
                    self.store.put_stream(self.key(name), f)
                    self._shipped[name] = seen

    def _ship_log(self) -> None:
        with (
            contextlib.suppress(FileNotFoundError, UnsafeOutput),
            open_inside(self.scratch, LOG) as f,
        ):
            size = os.fstat(f.fileno()).st_size
            if size == self._log_shipped:
                return
            local = self.store.local_path(self.key(LOG))
            if local is not None and size > self._log_shipped:
                # A local store's log grows by appends, so a reader following it with
                # X-Log-Offset never sees it shrink or rewritten.
                f.seek(self._log_shipped)
                local.parent.mkdir(parents=True, exist_ok=True)
                with open(local, "ab") as out:
                    shutil.copyfileobj(f, out)
            else:
                self.store.put_stream(self.key(LOG), f)
            self._log_shipped = size

    def remove_scratch(self) -> None:
        remove_tree(self.scratch)


def remove_tree(path: Path) -> None:
    """Remove a scratch folder the child may have made read-only."""

    def unlock(_func: Any, target: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(target), 0o700)
            os.chmod(target, 0o700)
        with contextlib.suppress(OSError):
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target, ignore_errors=True)
            else:
                os.unlink(target)

    shutil.rmtree(path, onerror=unlock)


def stage(
    storage: Storage,
    spec: dict[str, Any],
    files: JobFiles,
    *,
    resume_step: int | None,
    data_cache: Path,
    code_cache: Path,
) -> Staged:
    """Everything the child reads, in place before it starts. A bundle that fails its digest
    or is gone from the store is a JobError (a retry would find the same); a store that does
    not answer is any other exception (perhaps transient: a retry)."""
    files.restore_log()
    resumed = resume_step if resume_step and files.restore_checkpoint(resume_step) else None
    return Staged(
        scratch=files.scratch,
        data=data_dir_for(storage, spec, data_cache),
        bundle=bundle_for(storage, spec, code_cache, files.scratch / LOG),
        resume_step=resumed,
    )


def data_dir_for(storage: Storage, spec: dict[str, Any], cache: Path) -> Path:
    """A local directory holding the dataset the spec names: the store's own directory, or a
    per-host cache that the dataset is downloaded into (once per version: an upload never
    replaces a dataset, so name and size identify it)."""
    root = storage.data.local_root()
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        return root
    cache.mkdir(parents=True, exist_ok=True)
    data = spec.get("data", {})
    if data.get("kind") == "npz":
        key = check_key(data["path"])
        size = storage.data.size(key)
        target = cache / key
        if size is not None and not (target.is_file() and target.stat().st_size == size):
            storage.data.get_file(key, target)
    return cache


def bundle_for(
    storage: Storage, spec: dict[str, Any], cache: Path, log: Path | None = None
) -> Path | None:
    """The job's code bundle in this host's cache (fetched from the store and checked against
    its digest), or None for a job without code. ``log`` is told where it came from."""
    bundle = (spec.get("code") or {}).get("bundle")
    if bundle is None:
        return None
    fetched = not (cache / code.hex_of(bundle)).is_dir()
    try:
        tree = codestore.fetch(storage.code, cache, bundle)
    except (codestore.BundleCorrupt, NotFound) as exc:
        raise JobError(exc.message) from None
    if fetched and log is not None:
        where = storage.code.url(codestore.key_for(bundle))
        with open(log, "a") as f:
            f.write(f"halfway: code bundle {bundle} fetched from {where}\n")
    return tree


def bundle_hex(spec: dict[str, Any]) -> str | None:
    bundle = (spec.get("code") or {}).get("bundle")
    return None if bundle is None else code.hex_of(bundle)


def open_payload_storage(payload: dict[str, Any]) -> Storage:
    return open_storage(StorageConfig.from_dict(payload["storage"]))
