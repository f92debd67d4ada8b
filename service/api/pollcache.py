"""Short-lived snapshots of job summaries, for dashboards that poll.

Two hundred dashboards polling one job every second would otherwise cost two hundred reads
of the job row and two hundred history queries per second, competing with the worker that
writes the history. A snapshot is reused for ``ttl`` seconds: polls within that window cost
a dictionary lookup; a poll already at the snapshot's last step gets its empty page without
touching the database; and new rows are served only up to the snapshot's last step, so the
pollers' cursors meet on the same steps and one query answers all of them (``Page``).
The job list's pages are kept the same way (``Listing``); a job's part of a listing is
encoded again only when its row has changed (``item``). Staleness is bounded by ``ttl``
(0.5 s by default); changes made through this API process (a submission, a sweep, a cancel,
a priority) drop the snapshot and the listings at once, and a load that was already reading
the job when they did is not stored (``forget`` moves the generation on): the next poll reads again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from service.api.etag import etag_of, serialize
from service.api.responses import JobOut


@dataclass(frozen=True)
class Snapshot:
    body: bytes
    etag: str
    status: str
    last_step: int | None
    taken: float
    history_version: int = 0
    history_reset_step: int | None = None


@dataclass(frozen=True)
class Page:
    """A history page cut at a snapshot's last step, so every poller that was at the same
    step asks for, and gets, the same page."""

    body: bytes
    etag: str
    taken: float  # the snapshot it belongs to


@dataclass(frozen=True)
class Listing:
    """A page of the job list (``GET /v1/jobs``), the same for every caller: a dashboard
    reads it on every refresh, and a hundred jobs' summaries cost far more to load and
    encode than a job's snapshot."""

    body: bytes
    etag: str
    taken: float


# What a listing is kept by: status, owner, the cursor's job id and the limit.
ListKey = tuple[str | None, str | None, int | None, int]
# What a history page is kept by: its kind, its job, then what selects it: (after_step, limit)
# for "rows" and "columns", (points, from_step, to_step) for "buckets".
PageKey = tuple[str, int, int | None, int | None] | tuple[str, int, int, int | None, int | None]
_Aged = TypeVar("_Aged", Snapshot, Listing)
K = TypeVar("K")
V = TypeVar("V")


class PollCache:
    """Snapshots and pages, each refreshed by one thread at a time: when a snapshot expires
    under two hundred pollers, one of them reloads it and the others wait for that (instead of
    all reloading at once, each invalidating the others' pages)."""

    def __init__(self, ttl: float, size: int = 4096) -> None:
        self.ttl = ttl
        self.size = size
        self._items: dict[int, Snapshot] = {}
        self._pages: dict[PageKey, Page] = {}
        self._lists: dict[ListKey, Listing] = {}
        self._list_items: dict[int, tuple[bytes, bytes]] = {}  # job id: (its row, its JSON)
        self._lock = threading.Lock()
        self._flights: dict[object, threading.Lock] = {}
        # Moved on by every forget. A load that began under an older generation may have read
        # the job before the change that forgot it was committed, so it is not stored. One
        # counter for all jobs: forgets are rare (a cancel, a priority change), loads are not.
        self._generation = 0

    def single_flight(self, key: object) -> threading.Lock:
        """The lock that serializes refreshing ``key``."""
        with self._lock:
            if len(self._flights) >= self.size:
                self._flights.clear()
            return self._flights.setdefault(key, threading.Lock())

    def snapshot(self, job_id: int, load: Callable[[], JobOut]) -> Snapshot:
        """The fresh snapshot, loading it if needed; one loader per job at a time."""
        if self.ttl <= 0:
            return self.store(job_id, load())
        with self.single_flight(("job", job_id)):
            snap = self.fresh(job_id)
            if snap is not None:
                return snap
            generation = self._generation
            return self.store(job_id, load(), generation)

    def fresh(self, job_id: int) -> Snapshot | None:
        return self._young(self._items.get(job_id))

    def _young(self, item: _Aged | None) -> _Aged | None:
        """``item`` if it was taken within ``ttl``."""
        if self.ttl <= 0 or item is None or time.monotonic() - item.taken > self.ttl:
            return None
        return item

    def _keep(self, items: dict[K, V], key: K, value: V, generation: int | None = None) -> None:
        """Keep ``value`` under ``key``, unless it was loaded under ``generation`` and a
        forget has happened since (see ``store``)."""
        if self.ttl <= 0:
            return
        with self._lock:
            if generation is not None and generation != self._generation:
                return
            if len(items) >= self.size:
                items.clear()
            items[key] = value

    def store(self, job_id: int, out: JobOut, generation: int | None = None) -> Snapshot:
        """Keep ``out`` as the job's snapshot, unless it was loaded under ``generation`` and
        a forget has happened since: then it only answers the poll that loaded it, which was
        under way when the change was made."""
        body = serialize(out)
        snap = Snapshot(
            body,
            etag_of(body),
            out.status,
            out.summary.last_step,
            time.monotonic(),
            out.history_version,
            out.history_reset_step,
        )
        self._keep(self._items, job_id, snap, generation)
        return snap

    def page(self, key: PageKey, snap: Snapshot) -> Page | None:
        """The page kept under ``key`` if it was read under ``snap``, the job's snapshot now:
        every poller at the same cursor, and every dashboard drawing the same buckets of a
        long run, reads the one page again until the run has moved."""
        page = self._pages.get(key)
        return page if page is not None and page.taken == snap.taken else None

    def store_page(self, key: PageKey, snap: Snapshot, body: bytes, history_version: int) -> Page:
        """Keep a page read after ``snap`` was taken; ``history_version`` goes into its ETag
        (the snapshot's for a page cut at it, the page's own read of the job for buckets)."""
        page = Page(body, etag_of(body, history_version), snap.taken)
        self._keep(self._pages, key, page)
        return page

    def listing(self, key: ListKey, load: Callable[[], bytes]) -> Listing:
        """The fresh listing for ``key``, loading it (one loader at a time) if needed."""
        found = self.fresh_listing(key)
        if found is not None:
            return found
        with self.single_flight(("list", key)):
            found = self.fresh_listing(key)
            if found is not None:
                return found
            generation = self._generation
            body = load()
            listing = Listing(body, etag_of(body), time.monotonic())
            self._keep(self._lists, key, listing, generation)
            return listing

    def item(self, job_id: int, row: bytes, encode: Callable[[], bytes]) -> bytes:
        """A job's JSON in a listing: the one encoded from the same ``row`` (the text of every
        column it is made from), else ``encode()``. When the list's cache age runs out, only
        the jobs that changed since (a running one) cost an encoding; no ``forget`` is needed,
        since the row itself is the key."""
        kept = self._list_items.get(job_id)
        if kept is not None and kept[0] == row:
            return kept[1]
        body = encode()
        self._keep(self._list_items, job_id, (row, body))
        return body

    def fresh_listing(self, key: ListKey) -> Listing | None:
        return self._young(self._lists.get(key))

    def forget(self, job_id: int | None = None) -> None:
        """Drop the job's snapshot and every listing after a change committed through this
        process (None: a new job, which is in no snapshot yet but belongs in the lists)."""
        with self._lock:
            self._generation += 1
            if job_id is not None:
                self._items.pop(job_id, None)
            self._lists.clear()
