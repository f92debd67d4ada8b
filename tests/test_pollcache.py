"""The poll cache after a write: a cancel or a priority change made through an API process is
seen by that process's next poll, even when a snapshot load was already under way when the
change was committed. Real app, real HTTP, both databases."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from service import jobs
from service.app import create_app
from service.db import Database
from service.pollcache import PollCache, Snapshot
from service.responses import JobOut
from service.routes.jobs import job_out
from service.settings import Settings
from tests.conftest import Api, Team
from tests.live import free_port


def _submit(api: Api) -> int:
    r = api.post("/v1/jobs", json={})
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


@pytest.mark.parametrize("change", ["cancel", "priority"])
def test_a_load_under_way_during_a_change_is_not_kept(
    settings: Settings, db: Database, team: Team, change: str
) -> None:
    """The exact interleaving: a poll's load reads the job, the change commits and forgets the
    snapshot, then the load finishes. Its old state must not become the snapshot."""
    settings.poll_cache_seconds = 60  # a stale snapshot would outlive the test
    with TestClient(create_app(settings, db, auth=True)) as client:
        api = Api(client, team.alice)
        job_id = _submit(api)
        cache: PollCache = client.app.state.poll_cache  # type: ignore[attr-defined]
        read, go_on = threading.Event(), threading.Event()
        answered: list[Snapshot] = []

        def load() -> JobOut:
            with db.read() as session:
                out = job_out(jobs.get_job(session, job_id))
            read.set()
            assert go_on.wait(10)
            return out

        poll = threading.Thread(target=lambda: answered.append(cache.snapshot(job_id, load)))
        poll.start()
        assert read.wait(10)
        if change == "cancel":
            assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        else:
            assert api.patch(f"/v1/jobs/{job_id}", json={"priority": 90}).status_code == 200
        go_on.set()
        poll.join(10)
        assert answered and answered[0].status == "queued"  # the poll that was under way
        now = api.get(f"/v1/jobs/{job_id}").json()
        if change == "cancel":
            assert (now["status"], now["cancel_requested"]) == ("cancelled", True)
        else:
            assert now["priority"] == 90


# --------------------------------------------------------------------------------------------
# Many pollers racing a cancel, through a real server.


# A big model's job: its precision report names every layer's dtypes, so reading and
# serializing the job takes a few milliseconds, the window in which a cancel can land.
LAYERS = [
    {
        "layer": f"block_{i}/dense",
        "class": "Dense",
        "variable_dtype": "float32",
        "compute_dtype": "float16",
        "output_dtype": "float16",
    }
    for i in range(600)
]


@pytest.fixture
def server(settings: Settings, db: Database) -> Iterator[str]:
    # Long: a stale snapshot, once stored, would answer every later poll of the round.
    settings.poll_cache_seconds = 5
    port = free_port()
    app = create_app(settings, db, auth=True)
    srv = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None)
    )
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(20)


@dataclass
class Round:
    job_id: int
    cancelled_at: float = float("inf")  # until the cancel has returned
    stop: threading.Event = field(default_factory=threading.Event)
    stale: list[tuple[float, str]] = field(default_factory=list)
    polls_after: int = 0


POLLERS = 12
ROUNDS = 40


def test_every_poll_after_a_cancel_sees_it_under_many_concurrent_pollers(
    server: str, team: Team, db: Database
) -> None:
    """Each round: a new job, twelve pollers start on it at once (so the first poll loads its
    snapshot while the others wait for that load), and the cancel is sent a little later,
    the delay swept across rounds so that some cancels commit while the load is under way.
    Every poll sent after the cancel returned must see it."""
    headers = Team.header(team.alice)
    lock = threading.Lock()
    begin = threading.Barrier(POLLERS + 1)
    end = threading.Barrier(POLLERS + 1)
    rounds: list[Round] = []
    current: list[Round] = []  # the round under way; empty: the pollers go home

    def poller() -> None:
        with httpx.Client(base_url=server, headers=headers, timeout=10) as c:
            while True:
                begin.wait()
                if not current:
                    return
                r = current[-1]
                while not r.stop.is_set():
                    sent = time.monotonic()
                    job = c.get(f"/v1/jobs/{r.job_id}").json()
                    with lock:
                        if sent > r.cancelled_at:
                            r.polls_after += 1
                            if job["status"] != "cancelled":
                                r.stale.append((sent - r.cancelled_at, job["status"]))
                end.wait()

    threads = [threading.Thread(target=poller) for _ in range(POLLERS)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=server, headers=headers, timeout=10) as admin:
            for n in range(ROUNDS):
                job_id = admin.post("/v1/jobs", json={}).json()["id"]
                with db.write() as session:
                    jobs.get_job(session, job_id).precision_report = LAYERS
                r = Round(job_id)
                rounds.append(r)
                current[:] = [r]
                begin.wait()
                time.sleep((n % 20) * 0.0005)
                assert admin.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
                with lock:
                    r.cancelled_at = time.monotonic()
                deadline = time.monotonic() + 5
                while r.polls_after < POLLERS and time.monotonic() < deadline:
                    time.sleep(0.005)  # a poll or so per poller after the cancel
                r.stop.set()
                end.wait()
    finally:
        current.clear()
        begin.wait(10)  # releases the pollers: no round left
        for t in threads:
            t.join(10)
    stale = [(r.job_id, r.stale[:2], len(r.stale)) for r in rounds if r.stale]
    assert all(r.polls_after >= POLLERS for r in rounds), "too few polls to tell"
    assert stale == [], "polls sent after the cancel returned saw the old state"


@pytest.mark.parametrize("change", ["submit", "sweep", "cancel", "priority"])
def test_the_job_list_is_cached_and_a_change_through_the_api_is_seen_at_once(
    settings: Settings, db: Database, team: Team, change: str
) -> None:
    """Every dashboard reads the job list on each refresh: within the cache's age it is
    answered from memory (a change behind the API's back, as another worker or API
    process would make, shows once the listing has aged), while a change made through this
    process is in the very next list."""
    settings.poll_cache_seconds = 60  # the listing outlives the test unless dropped
    with TestClient(create_app(settings, db, auth=True)) as client:
        api = Api(client, team.alice)
        first = _submit(api)
        listed = api.get("/v1/jobs?limit=100")
        assert [j["id"] for j in listed.json()["items"]] == [first]
        with db.write() as session:  # behind the API's back
            jobs.get_job(session, first).name = "renamed elsewhere"
        again = api.get("/v1/jobs?limit=100", headers={"If-None-Match": listed.headers["etag"]})
        assert again.status_code == 304  # the listing in memory
        if change in ("submit", "sweep"):
            if change == "submit":
                expected = [_submit(api), first]
            else:
                r = api.post("/v1/sweeps", json={"base": {}, "policies": ["float32", "float32"]})
                assert r.status_code == 201, r.text
                ids = [v["job_id"] for v in r.json()["variants"]]
                expected = [*sorted(ids, reverse=True), first]
        elif change == "cancel":
            assert api.post(f"/v1/jobs/{first}/cancel").status_code == 202
            expected = [first]
        else:
            assert api.patch(f"/v1/jobs/{first}", json={"priority": 7}).status_code == 200
            expected = [first]
        now = api.get("/v1/jobs?limit=100").json()["items"]
        assert [j["id"] for j in now] == expected
        mine = next(j for j in now if j["id"] == first)
        assert mine["name"] == "renamed elsewhere"  # the change reloaded the list
        if change == "cancel":
            assert mine["cancel_requested"] or mine["status"] == "cancelled"
        if change == "priority":
            assert mine["priority"] == 7
