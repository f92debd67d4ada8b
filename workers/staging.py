"""A training child's files: Keras writes to a local directory, and this puts what it wrote
into the store (and brings in what a resumed attempt needs: its log, checkpoint, dataset
and code bundle). No TensorFlow.

On a local store (``file://``, the default) the local directory *is* the job's folder in the
store, so nothing is copied and the API sees the log as it is written. On a remote store it
is a scratch directory on this host's disk: checkpoints are uploaded and committed as they are
written, the log and TensorBoard files are shipped every few seconds and at the end, the model
once it is saved, and a dataset is downloaded once per host."""

from __future__ import annotations

import contextlib
import shutil
import threading
from pathlib import Path
from typing import Any

from service import code, codestore
from service.errors import NotFound
from service.storage import Storage, StorageConfig, Store, check_key, open_storage
from workers import checkpoints
from workers.protocol import JobError

LOG = "train.log"
TENSORBOARD = "tensorboard"
SHIP_SECONDS = 2.0


class JobFiles:
    def __init__(self, store: Store, prefix: str, local_dir: Path) -> None:
        self.store, self.prefix, self.local_dir = store, prefix, local_dir
        self.remote = store.local_path(prefix) != local_dir.resolve()
        self._shipped: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def local(job_dir: Path) -> JobFiles:
        """A job folder that is its own store (tests and tools that train in place)."""
        from service.storage import FileStore

        return JobFiles(FileStore(job_dir.parent), job_dir.name, job_dir)

    @staticmethod
    def for_job(storage: Storage, job_id: int, scratch: Path) -> JobFiles:
        prefix = str(job_id)
        local = storage.artifacts.local_path(prefix) or scratch / "jobs" / prefix
        local.mkdir(parents=True, exist_ok=True)
        return JobFiles(storage.artifacts, prefix, local)

    def key(self, name: str) -> str:
        return check_key(f"{self.prefix}/{name}")

    # Checkpoints ----------------------------------------------------------------------------

    def commit_checkpoint(self, step: int, local: Path) -> None:
        checkpoints.commit(self.store, self.prefix, step, local)
        if self.remote:
            local.unlink(missing_ok=True)  # it is in the store now; scratch is not a cache

    def fetch_checkpoint(self, step: int) -> Path | None:
        return checkpoints.fetch(self.store, self.prefix, step, self.local_dir)

    # Everything else ------------------------------------------------------------------------

    def publish(self, name: str) -> None:
        """Upload one finished file (the saved model)."""
        if self.remote:
            self.store.put_file(self.key(name), self.local_dir / name)

    def restore_log(self) -> None:
        """A later attempt on another host appends to the log the earlier ones wrote."""
        if self.remote:
            self.store.get_file(self.key(LOG), self.local_dir / LOG)

    def ship(self) -> None:
        """Upload the log and TensorBoard files that changed since the last call."""
        if not self.remote:
            return
        with self._lock:
            files = [self.local_dir / LOG]
            board = self.local_dir / TENSORBOARD
            if board.is_dir():
                files += sorted(p for p in board.rglob("*") if p.is_file())
            for path in files:
                with contextlib.suppress(FileNotFoundError):
                    stat = path.stat()
                    name = path.relative_to(self.local_dir).as_posix()
                    seen = (stat.st_size, stat.st_mtime_ns)
                    if self._shipped.get(name) != seen:
                        self.store.put_file(self.key(name), path)
                        self._shipped[name] = seen

    def start_shipping(self, stop: threading.Event, every: float = SHIP_SECONDS) -> None:
        if not self.remote:
            return

        def loop() -> None:
            while not stop.wait(every):
                try:
                    self.ship()
                except Exception as exc:  # the store is down: try again next round
                    print(f"halfway: shipping the log failed: {exc}", flush=True)

        threading.Thread(target=loop, name="halfway-ship", daemon=True).start()

    def clean_scratch(self) -> None:
        if self.remote:
            shutil.rmtree(self.local_dir, ignore_errors=True)


def data_dir_for(storage: Storage, spec: dict[str, Any], scratch: Path) -> Path:
    """A local directory holding the dataset the spec names: the store's own directory, or a
    per-host cache under scratch that the dataset is downloaded into (once per version: an
    upload never replaces a dataset, so name and size identify it)."""
    root = storage.data.local_root()
    if root is not None:
        return root
    cache = scratch / "data"
    data = spec.get("data", {})
    if data.get("kind") == "npz":
        key = check_key(data["path"])
        size = storage.data.size(key)
        target = cache / key
        if size is not None and not (target.is_file() and target.stat().st_size == size):
            storage.data.get_file(key, target)
    return cache


def code_dir_for(storage: Storage, spec: dict[str, Any], cache: Path) -> Path:
    """This host's cache of code bundles, holding the job's own (for a code job): fetched
    from the store, checked against its digest, once per host. A bundle the store no longer
    holds, or holds changed, fails the job (a JobError): a retry would find the same."""
    bundle = (spec.get("code") or {}).get("bundle")
    if bundle is None:
        return cache
    try:
        fetched = not (cache / code.hex_of(bundle)).is_dir()
        root = codestore.fetch(storage.code, cache, bundle)
    except (codestore.BundleCorrupt, NotFound) as exc:
        raise JobError(exc.message) from None
    if fetched:
        where = storage.code.url(codestore.key_for(bundle))
        print(f"halfway: code bundle {bundle} fetched from {where}", flush=True)
    return root.parent


def open_payload_storage(payload: dict[str, Any]) -> Storage:
    return open_storage(StorageConfig.from_dict(payload["storage"]))
