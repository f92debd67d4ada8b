"""Clients learn that history was rewritten: each resume that replaces recorded steps moves
the job's ``history_version`` on; every history page, bucket page and ETag carries it, and the
event stream sends ``reset`` and ids an EventSource reconnects with. Real app, real server for
the streams, real supervisor with a fake trainer for the resume; SQLite and PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from service.api import pages
from service.api.responses import BucketPage, HistoryPage
from service.api.routes import history as history_routes
from service.database.db import Database
from service.database.models import Job
from service.recording import history
from service.recording.records import StepRecord
from service.settings import Settings
from tests import fakes
from tests.conftest import Api, Team
from tests.live import Live
from tests.test_history_queries import brute_force, submit, synthetic_history, write
from tests.test_supervisor import make_job
from tests.waiting import eventually
from workers.supervisor import Supervisor


def truncate(db: Database, job_id: int, step: int) -> None:
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        history.truncate_after(s, job, step)


def rewrite(db: Database, job_id: int, cut: int, until: int, seed: int) -> list[StepRecord]:
    """What a resumed attempt does: forget from the cut, then train those steps again."""
    truncate(db, job_id, cut)
    again = synthetic_history(until - cut, seed=seed, start=cut)
    write(db, job_id, again)
    return again


def test_a_rewrite_moves_the_version_on_and_every_page_and_etag_says_so(
    api: Api, db: Database
) -> None:
    job_id = submit(api)
    first = synthetic_history(200, seed=1)
    write(db, job_id, first)
    tail = api.get(f"/v1/jobs/{job_id}/history?after_step=199")
    assert tail.json()["items"] == []
    assert (tail.json()["history_version"], tail.json()["history_reset_step"]) == (0, None)
    assert tail.headers["etag"].startswith('"h0-')
    buckets = api.get(f"/v1/jobs/{job_id}/history?points=10")
    assert buckets.json()["history_version"] == 0
    assert api.get(f"/v1/jobs/{job_id}").json()["history_version"] == 0

    rewrite(db, job_id, 100, 200, seed=2)
    # The same empty page at the tail as before: only the version tells the poller that rows
    # 100..199 it holds were replaced, so its ETag must not match any more.
    page = eventually(
        lambda: api.get(
            f"/v1/jobs/{job_id}/history?after_step=199",
            headers={"If-None-Match": tail.headers["etag"]},
        ),
        lambda r: r.status_code == 200,
    )
    HistoryPage.model_validate(page.json())
    assert (page.json()["history_version"], page.json()["history_reset_step"]) == (1, 100)
    assert page.json()["items"] == []
    assert page.headers["etag"].startswith('"h1-')
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert (job["history_version"], job["history_reset_step"]) == (1, 100)
    # Starting over from the cut gives the rows that are there now.
    rows = api.get(f"/v1/jobs/{job_id}/history?after_step=99&limit=500").json()["items"]
    now = stored(db, job_id)
    assert {r["step"]: r["loss"] for r in rows} == {s: v for s, v in now.items() if s >= 100}
    bpage = api.get(
        f"/v1/jobs/{job_id}/history?points=10", headers={"If-None-Match": buckets.headers["etag"]}
    )
    assert bpage.status_code == 200
    BucketPage.model_validate(bpage.json())
    assert (bpage.json()["history_version"], bpage.json()["history_reset_step"]) == (1, 100)
    assert bpage.headers["etag"].startswith('"h1-')
    compared = api.get(f"/v1/history?job_ids={job_id}&points=5").json()
    assert compared["jobs"][0]["history_version"] == 1


def test_a_cut_that_forgets_nothing_keeps_the_version(api: Api, db: Database) -> None:
    job_id = submit(api)
    write(db, job_id, synthetic_history(50, seed=3))
    truncate(db, job_id, 50)  # the first attempt starts at its own end: nothing replaced
    truncate(db, job_id, 80)
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert (job.history_version, job.history_reset_step) == (0, None)
    truncate(db, job_id, 10)
    truncate(db, job_id, 5)
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert (job.history_version, job.history_reset_step) == (2, 5)


# --------------------------------------------------------------------------------------------
# The event stream, on a real server


class Stream:
    """One event-stream connection, read in a thread: (event, id, data) as they arrive."""

    def __init__(self, live: Live, job_id: int, headers: dict[str, str] | None = None) -> None:
        self.events: list[tuple[str, str | None, Any]] = []
        self.status: int | None = None
        self.error: BaseException | None = None  # what ended the reading thread, if anything
        self._client = httpx.Client(base_url=live.url, timeout=30)
        self._headers = {**Team.header(live.team.alice), **(headers or {})}
        self._stop = threading.Event()
        self._socket: socket.socket | None = None
        self._thread = threading.Thread(target=self._read, args=(job_id,), daemon=True)
        self._thread.start()

    def _read(self, job_id: int) -> None:
        try:
            with self._client.stream(
                "GET", f"/v1/jobs/{job_id}/events", headers=self._headers
            ) as r:
                self.status = r.status_code
                self._socket = r.extensions["network_stream"].get_extra_info("socket")
                name, event_id = None, None
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        name = line[len("event: ") :]
                    elif line.startswith("id: "):
                        event_id = line[len("id: ") :]
                    elif line.startswith("data: ") and name is not None:
                        self.events.append((name, event_id, json.loads(line[len("data: ") :])))
                        name = None
                        if self.events[-1][0] == "end":
                            return
        except BaseException as error:
            if not self._stop.is_set():
                self.error = error
                raise

    def wait(
        self, ok: Callable[[list[tuple[str, str | None, Any]]], bool], timeout: float = 20.0
    ) -> None:
        """Until the events so far satisfy ``ok``. A stream that ended without is a failure at
        once, naming its status and what ended it."""
        deadline = time.monotonic() + timeout
        while True:
            ended = not self._thread.is_alive()  # before the read: its last events are in it
            events = list(self.events)
            if ok(events):
                return
            assert not ended and time.monotonic() < deadline, (
                f"{'ended' if ended else 'still open'} with status {self.status}, "
                f"error {self.error!r}, events {events!r}"
            )
            time.sleep(0.05)

    def close(self) -> None:
        """Leave as a browser tab does: the connection goes away at once (a shutdown wakes
        the reading thread; closing the client alone would wait for the next byte)."""
        self._stop.set()
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)
        self._client.close()


def apply(
    events: list[tuple[str, str | None, Any]], held: dict[int, Any] | None = None
) -> dict[int, Any]:
    """What a client holds after the events, from ``held`` (nothing): rows by step, a reset
    dropping from its step."""
    held = dict(held or {})
    for name, _, data in events:
        if name == "reset":
            held = {s: r for s, r in held.items() if s < data["from_step"]}
        elif name == "steps":
            held |= {r["step"]: r["loss"] for r in data["items"]}
    return held


def stored(db: Database, job_id: int) -> dict[int, Any]:
    with db.read() as s:
        rows, _ = history.read_steps(s, job_id, after_step=-1, limit=100_000)
    return {r.step: pages.step_dict(r)["loss"] for r in rows}


@pytest.fixture
def fast_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history_routes, "SSE_POLL_SECONDS", 0.05)


def last_step_sent(events: list[tuple[str, str | None, Any]]) -> int:
    return max((r["step"] for n, _, d in events if n == "steps" for r in d["items"]), default=-1)


@pytest.mark.usefixtures("fast_stream")
def test_the_stream_sends_a_reset_and_the_rows_that_replace_what_the_client_has(
    live: Live, db: Database
) -> None:
    job_id = live.submit({})
    write(db, job_id, synthetic_history(50, seed=4))
    stream = Stream(live, job_id)
    try:
        stream.wait(lambda ev: last_step_sent(ev) == 49)
        assert all(i is not None and i.startswith("0:") for _, i, _ in stream.events)
        rewrite(db, job_id, 20, 70, seed=5)
        stream.wait(lambda ev: any(n == "reset" for n, _, _ in ev) and last_step_sent(ev) == 69)
        with db.write() as s:
            job = s.get(Job, job_id)
            assert job is not None
            job.status = "succeeded"
        stream.wait(lambda ev: ev[-1][0] == "end")
    finally:
        stream.close()
    resets = [(i, d) for n, i, d in stream.events if n == "reset"]
    assert resets == [("1:19", {"history_version": 1, "from_step": 20})]
    assert apply(stream.events) == stored(db, job_id)
    assert stream.events[-1][1] == "1:69"


@pytest.mark.usefixtures("fast_stream")
def test_an_eventsource_reconnecting_with_last_event_id_goes_on_where_it_left_off(
    live: Live, db: Database
) -> None:
    job_id = live.submit({})
    write(db, job_id, synthetic_history(50, seed=6))
    first = Stream(live, job_id)
    try:
        first.wait(lambda ev: last_step_sent(ev) == 49)
    finally:
        first.close()
    last_id = [i for _, i, _ in first.events][-1]
    assert last_id == "0:49"
    # While the client is away, a resume rewrites from step 30 and goes on to 80.
    rewrite(db, job_id, 30, 80, seed=7)
    second = Stream(live, job_id, {"Last-Event-ID": last_id})
    try:
        second.wait(lambda ev: last_step_sent(ev) == 79)
    finally:
        second.close()
    assert second.events[0][0] == "reset"
    assert second.events[0][2] == {"history_version": 1, "from_step": 30}
    sent = [r["step"] for n, _, d in second.events if n == "steps" for r in d["items"]]
    assert sent == list(range(30, 80))
    assert apply(first.events + second.events) == stored(db, job_id)

    # Nothing rewritten since its id: it gets only what is new.
    write(db, job_id, synthetic_history(5, seed=8, start=80))
    third = Stream(live, job_id, {"Last-Event-ID": "1:79"})
    try:
        third.wait(lambda ev: last_step_sent(ev) == 84)
    finally:
        third.close()
    assert [n for n, _, _ in third.events if n == "reset"] == []
    assert [r["step"] for n, _, d in third.events if n == "steps" for r in d["items"]] == list(
        range(80, 85)
    )
    # Two rewrites missed: only the latest cut is known, so it starts over from step 0.
    rewrite(db, job_id, 60, 85, seed=9)
    rewrite(db, job_id, 70, 85, seed=10)
    fourth = Stream(live, job_id, {"Last-Event-ID": "1:84"})
    try:
        fourth.wait(lambda ev: last_step_sent(ev) == 84)
    finally:
        fourth.close()
    assert fourth.events[0][2] == {"history_version": 3, "from_step": 0}
    assert apply(fourth.events) == stored(db, job_id)


def test_a_malformed_last_event_id_is_a_422_naming_it(api: Api) -> None:
    job_id = submit(api)
    r = api.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "yesterday"})
    assert r.status_code == 422
    assert "last-event-id" in r.json()["fields"][0]["field"].lower()


def _open_streams(live: Live) -> float:
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("halfway_event_streams "))
    return float(line.split()[1])


@pytest.mark.usefixtures("fast_stream")
def test_the_server_releases_a_stream_whose_client_leaves(live: Live, db: Database) -> None:
    job_id = live.submit({})
    write(db, job_id, synthetic_history(10, seed=2))
    before = _open_streams(live)
    headers = Team.header(live.team.alice)
    with (
        httpx.Client(base_url=live.url, timeout=30) as client,
        client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as r,
    ):
        lines = r.iter_lines()  # held: dropping the iterator would already close the stream
        for line in lines:
            if line.startswith("event: steps"):
                break
        assert _open_streams(live) == before + 1
    # Gone mid-stream; the job is still queued, so the stream itself would never end.
    # The server notices and lets go of the stream and its polling of the database, though
    # nothing new was sent that could have failed to reach the client.
    eventually(lambda: _open_streams(live), lambda n: n == before, timeout=10)


# --------------------------------------------------------------------------------------------
# A real resume, through the supervisor


def test_a_resumed_attempt_that_dies_before_writing_leaves_history_and_buckets_exact(
    db: Database, settings: Settings, api: Api
) -> None:
    """Attempt 1 trains steps 0..199, checkpoints at 128 (a multiple of 64) and is killed;
    attempt 2 resumes from 128 and is killed before it sends a row. What remains is 0..127,
    and everything derived from it says so."""
    plan = [
        {"until": 200, "checkpoint_at": 128, "overflow_at": [150, 160], "then": "crash"},
        {"until": 128, "then": "crash"},
    ]
    job_id = make_job(db, {"mode": "plan", "plan": plan}, max_attempts=2)
    supervisor = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    assert supervisor.run_once()
    assert supervisor.run_once()
    job = eventually(
        lambda: api.get(f"/v1/jobs/{job_id}").json(), lambda j: j["status"] == "failed"
    )
    assert job["attempt"] == 2
    assert (job["history_version"], job["history_reset_step"]) == (1, 128)
    assert job["summary"]["last_step"] == 127 and job["summary"]["overflow_count"] == 0
    with db.read() as s:
        rows, _ = history.read_steps(s, job_id, after_step=-1, limit=1000)
    assert [r.step for r in rows] == list(range(128))
    records = [StepRecord(r.step, r.epoch, r.loss, r.loss_scale, r.finite) for r in rows]
    for points in (1, 2, 5):
        page = api.get(f"/v1/jobs/{job_id}/history?points={points}").json()
        expected = brute_force(
            records, page["from_step"], page["to_step"], page["origin"], page["width"]
        )
        assert {b["index"]: b for b in page["buckets"]} == expected
