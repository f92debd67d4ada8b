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
from sqlalchemy import event, select, update

from service.api.app import create_app
from service.api.etag import serialize
from service.api.pollcache import ListKey, PollCache, Snapshot
from service.api.responses import JobOut, JobPage
from service.api.routes import jobs as routes_jobs
from service.api.routes.jobs import job_listing, job_out
from service.database.db import Database
from service.database.models import Job
from service.scheduling import fairshare, jobs
from service.settings import Settings
from tests.conftest import Api, Team
from tests.live import free_port
from tests.test_claims import make_jobs
from tests.test_history_queries import check_buckets, synthetic_history, write


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


def _whole_page(db: Database, limit: int) -> bytes:
    """The list page encoded whole from the database, as the route did before items were kept."""
    with db.read() as session:
        rows = list(session.scalars(select(Job).order_by(Job.id.desc()).limit(limit + 1)))
        next_id = rows[limit - 1].id if len(rows) > limit else None
        rows = rows[:limit]
        # Queued jobs carry their place in the queue (service/scheduling/fairshare.py).
        places = {p.job_id: p for p in fairshare.queue(session, fairshare.Rule())}
        items = [routes_jobs.queued_out(j, routes_jobs.queue_spot(places.get(j.id))) for j in rows]
        page = JobPage(items=items, next_cursor=str(next_id) if next_id else None)
        return serialize(page)


# Changes behind the API's back (a worker's flush, another API process), each one that `==`
# on the decoded values would miss but JSON shows: the listing must show every one.
_CHANGES: list[tuple[str, object, object]] = [
    ("last_step", None, 41),
    ("loss_scale", 1024.0, 512.0),
    ("metrics", {"loss": 0.0}, {"loss": -0.0}),  # equal as floats, "0.0" vs "-0.0" in JSON
    ("metrics", {"accuracy": 1}, {"accuracy": 1.0}),  # equal in Python, "1" vs "1.0"
    ("metrics", {"a": 1, "b": 2}, {"b": 2, "a": 1}),  # equal dicts, keys in another order
    ("warnings", ["w"], ["w", "w2"]),
    ("device", {}, {"kind": "cpu", "name": "x"}),
]


@pytest.mark.parametrize(("column", "before", "after"), _CHANGES)
def test_a_listing_of_kept_items_is_the_page_encoded_whole_after_any_change(
    db: Database, column: str, before: object, after: object
) -> None:
    """A job's item in the list is kept by the text of its row: after a change of any column,
    in any way the JSON shows, the next listing equals the page encoded whole, byte for
    byte; and only the changed job is encoded again."""
    ids = make_jobs(db, 5)
    cache = PollCache(ttl=60)
    key: ListKey = (None, None, None, 100)
    changed = ids[2]
    with db.write() as session:
        session.execute(update(Job).where(Job.id == changed).values({column: before}))
    first = job_listing(db, cache, key)
    assert first.body == _whole_page(db, 100)
    with db.write() as session:
        session.execute(update(Job).where(Job.id == changed).values({column: after}))
    encoded: list[int] = []
    original = routes_jobs.job_out

    def counting(job: Job) -> JobOut:
        encoded.append(job.id)
        return original(job)

    cache.forget()  # the listing goes, the items stay
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routes_jobs, "job_out", counting)
        second = job_listing(db, cache, key)
    assert second.body == _whole_page(db, 100)
    assert second.body != first.body
    assert encoded == [changed]


def test_a_page_of_kept_items_is_serialize_of_the_page_with_or_without_a_cursor(
    db: Database,
) -> None:
    make_jobs(db, 3)
    cache = PollCache(ttl=60)
    for limit in (1, 2, 3, 10):
        assert job_listing(db, cache, (None, None, None, limit)).body == _whole_page(db, limit)


def test_a_bucket_page_is_read_once_per_snapshot_and_anew_after_it(
    settings: Settings, db: Database, team: Team
) -> None:
    """Every dashboard drawing a long run reads the same buckets again as the run moves:
    within the job's snapshot they are read from the database once (and a zoom or another
    width is a page of its own); the next snapshot reads them again, rows written since
    included, and every page equals the buckets computed over the rows by brute force."""
    settings.poll_cache_seconds = 60  # the snapshot ages only when the test says so
    records = synthetic_history(6000, seed=3)
    with TestClient(create_app(settings, db, auth=True)) as client:
        api = Api(client, team.alice)
        job_id = _submit(api)
        write(db, job_id, records[:4000])
        cache: PollCache = client.app.state.poll_cache  # type: ignore[attr-defined]
        queries: list[str] = []

        def seen(_conn: object, _cursor: object, statement: str, *_: object) -> None:
            if "FROM step" in statement:  # the history's tables (step, step_rollup)
                queries.append(statement)

        event.listen(db.engine, "before_cursor_execute", seen)
        try:
            first = check_buckets(api, job_id, records[:4000], 50)
            assert any("step_rollup" in q for q in queries)
            after_first = len(queries)
            for _ in range(5):
                assert check_buckets(api, job_id, records[:4000], 50) == first
            assert len(queries) == after_first  # not one read of the history
            zoomed = check_buckets(api, job_id, records[:4000], 50, 1000, 2000)
            assert zoomed != first
            assert len(queries) > after_first  # a page of its own
            write(db, job_id, records[4000:])
            # Until the snapshot ages the page is the one read under it.
            assert check_buckets(api, job_id, records[:4000], 50) == first
            cache.forget(job_id)  # as the snapshot's age running out does
            moved = check_buckets(api, job_id, records, 50)
            assert moved["to_step"] == 5999 and first["to_step"] == 3999
        finally:
            event.remove(db.engine, "before_cursor_execute", seen)
