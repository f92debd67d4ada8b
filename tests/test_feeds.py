"""The event stream's shared reads (``service.api.feeds``): listeners of one job, wherever they
start, each get every row once, a rewrite's reset and the end, while the database answers one
read per tick for all of them, not one per listener. Real server, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from collections.abc import Iterator
from contextlib import aclosing
from typing import Any

import pytest
from sqlalchemy import event

from service.api.feeds import KEEPALIVE, KEPT_EVENTS, Feeds, listen
from service.database.db import POOL_SIZE, Database
from service.database.models import Job
from service.recording.records import StepRecord
from tests.conftest import Api
from tests.live import Live
from tests.test_history_queries import submit, synthetic_history, write
from tests.test_history_version import Stream, apply, last_step_sent, rewrite, stored
from tests.waiting import eventually

POLL = 0.05


@pytest.fixture(autouse=True)
def fast_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.api.routes import history as history_routes

    monkeypatch.setattr(history_routes, "SSE_POLL_SECONDS", POLL)


def finish(db: Database, job_id: int) -> None:
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.status = "succeeded"


def in_order_between_resets(events: list[tuple[str, str | None, Any]]) -> bool:
    """Each row once: between two resets the steps sent only go up."""
    last = -1
    for name, _, data in events:
        if name == "reset":
            last = data["from_step"] - 1
        elif name == "steps":
            for row in data["items"]:
                if row["step"] <= last:
                    return False
                last = row["step"]
    return True


@pytest.fixture
def step_reads(db: Database) -> Iterator[list[float]]:
    """When each query that read the step table ran, in threads other than the test's writer
    (named "writer"): the server shares this engine."""
    times: list[float] = []

    def seen(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if threading.current_thread().name == "writer":
            return
        if statement.lstrip().upper().startswith("SELECT") and "FROM step " in statement:
            times.append(time.monotonic())

    event.listen(db.engine, "before_cursor_execute", seen)
    yield times
    event.remove(db.engine, "before_cursor_execute", seen)


def test_listeners_starting_anywhere_each_get_every_row_once_a_reset_and_the_end(
    live: Live, db: Database
) -> None:
    job_id = live.submit({})
    first = synthetic_history(60, seed=11)
    write(db, job_id, first)
    # From the start (a new client, no id), from the middle and at the end (an EventSource
    # reconnecting), and past the end (a client that claims more than there is).
    starts = [-1, 25, 59, 300]
    streams = [
        Stream(live, job_id, {"Last-Event-ID": f"0:{after}"} if after >= 0 else {})
        for after in starts
    ]
    try:
        for stream in streams[:3]:
            stream.wait(lambda ev: any(n == "status" for n, _, _ in ev))
        for start in range(60, 140, 16):  # a job flushing while they listen
            write(db, job_id, synthetic_history(16, seed=start, start=start))
            time.sleep(POLL)
        rewrite(db, job_id, 100, 170, seed=12)  # a resume replaces 100.. and goes on
        finish(db, job_id)
        for stream in streams:
            stream.wait(lambda ev: bool(ev) and ev[-1][0] == "end")
    finally:
        for stream in streams:
            stream.close()
    now = stored(db, job_id)
    assert sorted(now) == list(range(170))
    for stream, after in zip(streams, starts, strict=True):
        assert in_order_between_resets(stream.events), after
        assert stream.events[-1][2] == {"status": "succeeded", "last_step": 169}, after
        assert [n for n, _, _ in stream.events].count("end") == 1
        if after < 140:
            held = {s: loss for s, loss in losses(first).items() if s <= after}
            assert apply(stream.events, held) == now, after
        else:  # it held "everything" to 300: it gets the rewrite, from the cut on
            sent = [r["step"] for n, _, d in stream.events if n == "steps" for r in d["items"]]
            assert sent == list(range(100, 170))
            assert ("reset", {"history_version": 1, "from_step": 100}) in [
                (n, d) for n, _, d in stream.events
            ]


def losses(records: list[StepRecord]) -> dict[int, float | None]:
    """Rows as ``stored`` gives them: non-finite losses as null."""
    return {r.step: (r.loss if math.isfinite(r.loss) else None) for r in records}


def test_many_listeners_at_the_head_share_one_read_per_tick(
    live: Live, db: Database, step_reads: list[float]
) -> None:
    job_id = live.submit({})
    write(db, job_id, synthetic_history(10, seed=21))
    listeners = 16
    streams = [Stream(live, job_id) for _ in range(listeners)]
    stop = threading.Event()

    def train() -> None:  # a flush every other tick
        step = 10
        while not stop.is_set():
            write(db, job_id, synthetic_history(5, seed=step, start=step))
            step += 5
            time.sleep(2 * POLL)

    trainer = threading.Thread(target=train, name="writer", daemon=True)
    try:
        for stream in streams:
            stream.wait(lambda ev: last_step_sent(ev) >= 9)
        trainer.start()
        time.sleep(0.5)  # every listener is at the head, on the feed
        began, reads_before = time.monotonic(), len(step_reads)
        time.sleep(2.0)
        window, reads = time.monotonic() - began, len(step_reads) - reads_before
        stop.set()
        trainer.join()
        finish(db, job_id)
        for stream in streams:
            stream.wait(lambda ev: bool(ev) and ev[-1][0] == "end")
    finally:
        stop.set()
        for stream in streams:
            stream.close()
    ticks = window / POLL + 2
    # One read per tick for all (two when a read meets a rewrite or a full page); reading
    # per listener would be ``listeners`` per tick.
    assert reads <= 2 * ticks, (reads, ticks)
    now = stored(db, job_id)
    for stream in streams:
        assert apply(stream.events, losses(synthetic_history(10, seed=21))) == now
        assert in_order_between_resets(stream.events)


def test_a_listener_that_falls_behind_what_the_feed_keeps_reads_alone_and_misses_nothing(
    api: Api, db: Database
) -> None:
    """A slow client (its socket full, so its stream is not read) while the feed publishes
    more events than it keeps: the listener goes back to reading alone from where it was."""
    job_id = submit(api)
    write(db, job_id, synthetic_history(5, seed=31))

    async def scenario() -> list[tuple[str, str | None, Any]]:
        async def valid() -> bool:
            return True

        texts: list[str] = []
        async with Feeds(db).joined(job_id, POLL / 5) as feed:
            stream = listen(feed, -1, None, 60.0, valid)
            while "steps" not in "".join(texts):
                texts.append((await anext(stream)).decode())
            for start in range(5, 5 + 3 * (KEPT_EVENTS + 10), 3):  # not read meanwhile
                write(db, job_id, synthetic_history(3, seed=start, start=start))
                seq = feed.seq
                while feed.seq == seq:
                    await asyncio.sleep(POLL / 10)
            assert feed.since(0) is None  # the first events are gone
            finish(db, job_id)
            async for text in stream:
                texts.append(text.decode())
        return parse("".join(texts))

    events = asyncio.run(scenario())
    assert events[-1][0] == "end"
    assert in_order_between_resets(events)
    assert apply(events) == stored(db, job_id)
    assert len(stored(db, job_id)) == 5 + 3 * (KEPT_EVENTS + 10)


def parse(text: str) -> list[tuple[str, str | None, Any]]:
    """Server-sent events as (event, id, data); comments skipped."""
    events = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and line[0] != ":")
        if "event" in fields:
            events.append((fields["event"], fields.get("id"), json.loads(fields["data"])))
    return events


def test_more_listeners_than_the_database_pool_has_connections_all_hear_the_job(
    live: Live, db: Database
) -> None:
    """An open stream holds no pooled connection: with a request-scoped session held for
    each stream's life, the pool ran dry at its size, and the next requests (streams and
    polls alike) waited for a connection that never came back, each in a pool thread, until
    the server stopped answering."""
    job_id = live.submit({})
    write(db, job_id, synthetic_history(10, seed=41))
    count = POOL_SIZE + 20
    streams = [Stream(live, job_id) for _ in range(count)]
    try:
        for stream in streams:
            stream.wait(lambda ev: last_step_sent(ev) == 9)
        write(db, job_id, synthetic_history(10, seed=42, start=10))
        for stream in streams:
            stream.wait(lambda ev: last_step_sent(ev) == 19)
        # Polls are answered too (within the poll cache's age, the page may be the older one).
        eventually(
            lambda: live.api("GET", f"/v1/jobs/{job_id}/history?after_step=-1")["items"],
            lambda items: [r["step"] for r in items] == list(range(20)),
        )
    finally:
        for stream in streams:
            stream.close()


def test_a_quiet_stream_gets_a_keepalive_each_period_and_a_busy_one_none(
    api: Api, db: Database
) -> None:
    """A proxy may close a connection that stays silent: a listener that has sent nothing for
    the keepalive period sends a comment on the next tick. One that sends events more often
    than that never sends one. What counts is when the chunks came, not when the writes were
    meant to land: on a loaded machine one write may take longer than the period, and then a
    keepalive is right."""
    job_id = submit(api)
    write(db, job_id, synthetic_history(5, seed=51))
    keepalive, tick = 0.6, POLL / 5

    async def scenario() -> tuple[list[tuple[float, bytes]], float]:
        async def valid() -> bool:
            return True

        loop = asyncio.get_running_loop()
        received: list[tuple[float, bytes]] = []  # when each chunk came, and the chunk

        async def writes() -> float:  # a job flushing every 0.1 s; then it goes quiet
            for start in range(5, 5 + 3 * 16, 3):
                await asyncio.to_thread(write, db, job_id, synthetic_history(3, start, start))
                await asyncio.sleep(0.1)
            return loop.time()

        async with (
            Feeds(db).joined(job_id, tick) as feed,
            aclosing(listen(feed, -1, None, keepalive, valid)) as stream,
        ):
            writer = asyncio.create_task(writes())
            while not writer.done() or loop.time() < writer.result() + 4 * keepalive:
                text = await anext(stream)
                received.append((loop.time(), text))
        return received, writer.result()

    received, quiet_from = asyncio.run(scenario())
    texts = [text for _, text in received]
    assert stored(db, job_id) == apply(parse(b"".join(texts).decode()))
    last_event = max(at for at, text in received if text != KEEPALIVE)
    assert last_event < quiet_from + keepalive
    assert b"".join(texts).count(b"event: steps") >= 10
    # Every keepalive follows a silence of at least the period, the busy stretch included.
    silences = [
        (at - before, text == KEEPALIVE) for (before, _), (at, text) in itertools.pairwise(received)
    ]
    assert all(silence >= keepalive for silence, kept_alive in silences if kept_alive), silences
    # Once quiet, one comes each period (a tick late at most, and the loop's lag).
    quiet = [at for at, text in received if text == KEEPALIVE and at > last_event]
    assert len(quiet) >= 3, quiet
    gaps = [b - a for a, b in itertools.pairwise([last_event, *quiet])]
    assert all(keepalive <= gap < keepalive + 0.5 for gap in gaps), gaps
