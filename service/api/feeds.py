"""The event stream's reads, shared: one read per job per tick, fanned out to its listeners.

Two hundred dashboards listening to one job used to cost two hundred reads of the job and its
new rows every tick, and two hundred encodings of the same events. A ``Feed`` reads once per
tick, encodes the events once, and every listener at the feed's position (its *head*) sends
the same text. A listener that is elsewhere (it reconnected with an older ``Last-Event-ID``,
it asked for ``after_step`` far back, or it fell more than ``KEPT_EVENTS`` behind) reads
alone, as every listener used to, but only up to the head; there it joins the feed.

Positions are ``(history_version, last step sent)``. A resume that rewrites history moves the
version on; the feed sends ``reset`` and reads again from the cut, and a listener reading
alone does the same for itself (``catch_up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fastapi.concurrency import run_in_threadpool

from service.api.pages import step_dict
from service.api.routes.jobs import job_out
from service.database.db import Database
from service.database.models import FINISHED_STATUSES, Job
from service.metrics import EVENT_STREAMS
from service.recording import columnar, history
from service.scheduling import jobs

ROWS_PER_READ = 5000
KEEPALIVE = b": keepalive\n\n"
KEPT_EVENTS = 64  # a listener this far behind the feed reads alone until it is back


class FeedFailed(Exception):
    """The feed's read failed (the database, the job): the stream ends; a client reconnects."""


class Position(NamedTuple):
    version: int
    after: int  # the last step sent (-1: none)


def sse(event: str, data: Any, event_id: str) -> str:
    body = json.dumps(data, separators=(",", ":"))
    return f"event: {event}\nid: {event_id}\ndata: {body}\n\n"


def event_id(at: Position) -> str:
    return f"{at.version}:{at.after}"


class Read(NamedTuple):
    rows: list[dict[str, Any]]
    has_more: bool
    status: dict[str, Any]  # the whole job, as GET /v1/jobs/{id} answers it
    version: int
    reset_step: int | None
    last_step: int  # the job's last recorded step (-1: none)


def read(db: Database, job_id: int, after: int, up_to: int | None = None) -> Read:
    """The job and up to ``ROWS_PER_READ`` rows past ``after`` (and at most ``up_to``)."""
    with db.read() as session:
        job = jobs.get_job(session, job_id)  # before the rows: see page_body
        rows, has_more = history.read_steps(
            session, job_id, after_step=after, limit=ROWS_PER_READ, up_to=up_to
        )
        return _read(job, [step_dict(r) for r in rows], has_more)


def _read(job: Job, rows: list[dict[str, Any]], has_more: bool) -> Read:
    return Read(
        rows,
        has_more,
        job_out(job).model_dump(mode="json"),
        job.history_version,
        job.history_reset_step,
        job.last_step if job.last_step is not None else -1,
    )


def rewind(at: Position, version: int, reset_step: int | None) -> tuple[Position, str | None]:
    """Where a reader at ``at`` goes on once the history is at ``version``, and the ``reset``
    event to send if what it sent is no longer the history: from the cut when it missed one
    rewrite, from the start when it missed more (only the latest cut is kept)."""
    if version == at.version:
        return at, None
    one = version == at.version + 1 and reset_step is not None
    start = reset_step if one and reset_step is not None else 0
    if start > at.after:
        return Position(version, at.after), None
    moved = Position(version, start - 1)
    return moved, sse("reset", {"history_version": version, "from_step": start}, event_id(moved))


def render(at: Position, got: Read) -> tuple[Position, list[str]]:
    """The ``steps`` event for a read's rows (if any) and where the reader is after it."""
    if not got.rows:
        return at, []
    moved = Position(at.version, got.rows[-1]["step"])
    items = {"after_step": moved.after, "items": got.rows}
    return moved, [sse("steps", items, event_id(moved))]


def finished(got: Read) -> bool:
    return got.status["status"] in FINISHED_STATUSES and not got.has_more and not got.rows


def end_event(at: Position, status: dict[str, Any]) -> str:
    return sse("end", {"status": status["status"], "last_step": at.after}, event_id(at))


@dataclass
class Event:
    seq: int
    text: bytes  # encoded once, sent to every listener as is
    end: Position  # the position after it


@dataclass
class Feed:
    """One job's shared reads. ``run`` reads every ``poll_seconds`` while anyone listens."""

    job_id: int
    db: Database
    poll_seconds: float
    head: Position = field(default_factory=lambda: Position(0, -1))
    reset_step: int | None = None  # the head version's cut (see rewind)
    status: dict[str, Any] | None = None
    done: bool = False  # the job finished and every row was sent
    failed: Exception | None = None  # what the last read raised; the listeners raise it
    closing: bool = False  # its last listener left: a new one gets a new feed
    seq: int = 0
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=KEPT_EVENTS))
    listeners: int = 0
    task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _started: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, on_end: Callable[[Feed], None]) -> None:
        try:
            # The head starts at the job's last step; a listener behind it reads up to it.
            got = await run_in_threadpool(read, self.db, self.job_id, columnar.MAX_STEP)
            self.head = Position(got.version, got.last_step)
            self.reset_step = got.reset_step
            self.status = got.status
            self.done = finished(got)
            self._started.set()
            while not self.done:
                await asyncio.sleep(self.poll_seconds)
                if not await self.tick():
                    # Nothing new, but the listeners wake once a tick all the same (to check
                    # their tokens and send keepalives): one wake-up here, not a timer each.
                    self._wake()
        except Exception as error:  # a database outage, a deleted job: the streams end
            self.failed = error
        finally:
            self._started.set()
            self._wake()
            on_end(self)

    async def started(self) -> None:
        await self._started.wait()

    async def tick(self) -> bool:
        """Read past the head until nothing more is there, publishing one event per read;
        whether anything was published."""
        published = False
        while True:
            got = await run_in_threadpool(read, self.db, self.job_id, self.head.after)
            at, reset = rewind(self.head, got.version, got.reset_step)
            self.head, self.reset_step = at, got.reset_step
            if reset is not None:
                self._publish(reset)
                published = True
                continue  # read again from the cut
            at, texts = render(at, got)
            self.head = at
            if got.status != self.status:
                self.status = got.status
                texts.append(sse("status", got.status, event_id(at)))
            if finished(got):
                self.done = True
                texts.append(end_event(at, got.status))
            if texts:
                self._publish("".join(texts))
                published = True
            if not got.has_more:
                return published

    def _publish(self, text: str) -> None:
        self.seq += 1
        self.events.append(Event(self.seq, text.encode(), self.head))
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def since(self, seq: int) -> list[Event] | None:
        """The events after ``seq``; None when some of them are no longer kept."""
        if seq == self.seq:
            return []
        if not self.events or self.events[0].seq > seq + 1:
            return None
        return [e for e in self.events if e.seq > seq]

    async def changed(self) -> None:
        """Wait for the next event, or the end of a tick that had none."""
        await self._changed.wait()


class Feeds:
    """The feeds of one API process, by job. Asyncio objects belong to one event loop, so a
    feed made under another loop (a test client's) is not reused."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._feeds: dict[int, tuple[asyncio.AbstractEventLoop, Feed]] = {}

    @contextlib.asynccontextmanager
    async def joined(self, job_id: int, poll_seconds: float) -> AsyncIterator[Feed]:
        loop = asyncio.get_running_loop()
        found = self._feeds.get(job_id)
        if found is None or found[0] is not loop or found[1].closing or found[1].task is None:
            feed = Feed(job_id, self.db, poll_seconds)
            self._feeds[job_id] = (loop, feed)
            feed.task = loop.create_task(feed.run(self._ended), name=f"feed-{job_id}")
        else:
            feed = found[1]
        feed.listeners += 1
        try:
            await feed.started()
            yield feed
        finally:
            feed.listeners -= 1
            if feed.listeners == 0 and feed.task is not None:
                feed.closing = True
                feed.task.cancel()

    def _ended(self, feed: Feed) -> None:
        feed.task = None
        found = self._feeds.get(feed.job_id)
        if found is not None and found[1] is feed:
            del self._feeds[feed.job_id]


async def listen(
    feed: Feed,
    after: int,
    version: int | None,
    keepalive_seconds: float,
    still_valid: Callable[[], Awaitable[bool]],
) -> AsyncGenerator[bytes, None]:
    """One listener's events (``_events``), and a keepalive comment on a tick that finds it
    has sent nothing for ``keepalive_seconds``: a proxy may close a silent connection."""
    loop = asyncio.get_running_loop()
    sent = loop.time()
    async with contextlib.aclosing(_events(feed, after, version, still_valid)) as events:
        async for text in events:
            if text is None and loop.time() - sent <= keepalive_seconds:
                continue
            yield KEEPALIVE if text is None else text
            sent = loop.time()


async def _events(
    feed: Feed,
    after: int,
    version: int | None,
    still_valid: Callable[[], Awaitable[bool]],
) -> AsyncGenerator[bytes | None, None]:
    """One listener's events: alone until it reaches the feed's head, then the feed's; None
    for a tick that brought it nothing."""
    at = Position(feed.head.version if version is None else version, after)
    status: dict[str, Any] | None = None  # the last status this listener sent
    seq: int | None = None  # the last feed event it sent; None while it reads alone
    newer = False  # its version is one it read itself, newer than the feed's so far
    # It wakes at least once a tick (see Feed.run) and checks its token then, so a replaced
    # token ends the stream within a tick.
    if not await still_valid():
        return
    while True:
        if feed.failed is not None:
            raise FeedFailed(feed.job_id) from feed.failed
        head = feed.head
        if seq is not None:  # on the feed
            events = feed.since(seq)
            if events is None:  # fell behind what the feed keeps: read alone from here
                seq = None
                continue
            for e in events:
                yield e.text
                seq, at = e.seq, e.end
            status = feed.status
            if feed.done and seq == feed.seq:
                return
            if events:
                continue
        elif at == head or (feed.done and at.version == head.version and at.after > head.after):
            seq = feed.seq  # join
            if status != feed.status:
                # Its id is this position: an id behind it would make a client that
                # reconnects with it receive rows it holds again.
                yield sse("status", feed.status, event_id(at)).encode()
            if feed.done:
                yield end_event(at, feed.status or {}).encode()
                return
            continue
        elif at.version == head.version and at.after < head.after:
            got = await run_in_threadpool(read, feed.db, feed.job_id, at.after, head.after)
            at, reset = rewind(at, got.version, got.reset_step)
            newer = got.version > head.version  # the feed will read that version next tick
            if reset is not None:
                yield reset.encode()
                continue
            at, texts = render(at, got)
            if got.status != status:
                status = got.status
                texts.append(sse("status", status, event_id(at)))
            if texts:
                yield "".join(texts).encode()
            if not got.rows and not got.has_more and at.version == head.version:
                at = Position(at.version, head.after)  # no rows up to the head: a gap
            continue
        elif at.version != head.version and not (at.version > head.version and newer):
            # A rewrite since what it holds (or a version the job never had: from the start).
            at, reset = rewind(at, head.version, feed.reset_step)
            if reset is not None:
                yield reset.encode()
            continue
        # Nothing new on the feed, or ahead of it (this listener read alone what the feed
        # has not read yet): wait for the feed's next tick.
        await feed.changed()
        if not await still_valid():
            return
        yield None


async def stream(
    feeds: Feeds,
    job_id: int,
    after: int,
    version: int | None,
    poll_seconds: float,
    keepalive_seconds: float,
    still_valid: Callable[[], Awaitable[bool]],
) -> AsyncGenerator[bytes, None]:
    """One client's event stream, as the route and the lean path send it."""
    EVENT_STREAMS.inc()
    try:
        async with feeds.joined(job_id, poll_seconds) as feed:
            async for chunk in listen(feed, after, version, keepalive_seconds, still_valid):
                yield chunk
    finally:
        EVENT_STREAMS.dec()
