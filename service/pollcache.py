"""Short-lived snapshots of job summaries, for dashboards that poll.

Two hundred dashboards polling one job every second would otherwise cost two hundred reads
of the job row (and two hundred empty history queries) per second, competing with the worker
that writes the history. A snapshot is reused for ``ttl`` seconds: polls within that window
cost a dictionary lookup, and a poll that is already at the job's last step gets its empty
page without touching the database. Staleness is bounded by ``ttl`` (0.5 s by default);
changes made through this API process (cancel, priority) drop the snapshot at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from service.etag import etag_of, serialize
from service.schemas import JobOut


@dataclass(frozen=True)
class Snapshot:
    body: bytes
    etag: str
    status: str
    last_step: int | None
    taken: float


class PollCache:
    def __init__(self, ttl: float, size: int = 4096) -> None:
        self.ttl = ttl
        self.size = size
        self._items: dict[int, Snapshot] = {}
        self._lock = threading.Lock()

    def fresh(self, job_id: int) -> Snapshot | None:
        if self.ttl <= 0:
            return None
        snap = self._items.get(job_id)
        if snap is None or time.monotonic() - snap.taken > self.ttl:
            return None
        return snap

    def store(self, job_id: int, out: JobOut) -> Snapshot:
        body = serialize(out)
        snap = Snapshot(body, etag_of(body), out.status, out.summary.last_step, time.monotonic())
        if self.ttl > 0:
            with self._lock:
                if len(self._items) >= self.size:
                    self._items.clear()
                self._items[job_id] = snap
        return snap

    def forget(self, job_id: int) -> None:
        with self._lock:
            self._items.pop(job_id, None)
