"""The optional budget of slot-hours per user per window (service/scheduling/fairshare.py), on both
databases: what a run adds to its window, a new window starting from nothing, the claim and
the queue holding an owner who spent the budget (and only queued jobs), preemption never made
for such an owner, and the API and CLI that show it."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import select, update
from typer.testing import CliRunner

from service import cli
from service.database.db import Database
from service.database.dbclock import db_now
from service.database.models import Job, UserUsage
from service.scheduling import fairshare, jobs, preemption
from service.settings import Settings
from tests.conftest import Api, Team
from tests.test_claims import age_lease, claim, make_jobs

HOUR = 3600.0
WEEK = fairshare.DEFAULT_WINDOW
BUDGET = fairshare.Rule(budget_seconds=2 * HOUR)  # two slot-hours a week


def window_start(instant: datetime, length: float = WEEK) -> datetime:
    """The start of the budget window ``instant`` falls in, computed here independently."""
    since = (instant - fairshare.WINDOW_ORIGIN).total_seconds()
    return fairshare.WINDOW_ORIGIN + timedelta(seconds=since - since % length)


def database_now(db: Database) -> datetime:
    with db.read() as s:
        now: datetime | None = s.scalar(select(db_now()))
    assert now is not None and now.tzinfo is not None
    return now


def mid_window(db: Database) -> datetime:
    """Three days into the current week's window: far from both of its ends."""
    return window_start(database_now(db)) + timedelta(days=3)


def spend(db: Database, owner: str, seconds: float, index: int) -> None:
    now = database_now(db)
    with db.write() as s:
        s.merge(
            UserUsage(
                owner=owner,
                weight=1.0,
                usage_seconds=seconds,
                as_of=now,
                window_index=index,
                window_used=seconds,
            )
        )


def index_at(instant: datetime, length: float = WEEK) -> int:
    return int((instant - fairshare.WINDOW_ORIGIN).total_seconds() // length)


def run_since(db: Database, job_id: int, seconds: float) -> None:
    """The job's current run started ``seconds`` ago on the database's clock."""
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job_id).values(accrued_at=db_now(-seconds)))


def window_row(db: Database, owner: str) -> tuple[int | None, float]:
    with db.read() as s:
        row = s.get(UserUsage, owner)
        assert row is not None
        return row.window_index, row.window_used


def test_windows_start_on_monday_at_midnight_utc() -> None:
    assert fairshare.WINDOW_ORIGIN.weekday() == 0
    assert fairshare.WINDOW_ORIGIN.hour == fairshare.WINDOW_ORIGIN.minute == 0


def test_a_run_adds_only_its_time_within_the_current_window(db: Database) -> None:
    """A run that began before the window started counts from the window's start (GPU-seconds
    for a job holding GPUs); a count from an earlier window is replaced, one of the same
    window added to."""
    hours = fairshare.Rule(window_seconds=HOUR)
    (gpu_job,) = make_jobs(db, 1, owner="alice", resources={"gpus": 2})
    (cpu_job,) = make_jobs(db, 1, owner="alice")
    claim(db, "w1", gpus=2)
    run_since(db, gpu_job, 2 * HOUR)  # longer than any one-hour window
    with db.write() as s:
        assert jobs.finish(s, job_id=gpu_job, worker_id="w1", status="succeeded", rule=hours)
    now = database_now(db)
    index, used = window_row(db, "alice")
    assert index == index_at(now, HOUR)
    assert used == pytest.approx(2 * into(now, HOUR), abs=4)  # from the window's start, not 2 h
    with db.read() as s:
        usage = s.get(UserUsage, "alice")
        assert usage is not None and usage.usage_seconds == pytest.approx(4 * HOUR, abs=4)

    # A stale count (an earlier window) is replaced, not added to.
    with db.write() as s:
        s.execute(update(UserUsage).values(window_index=index - 1, window_used=5000.0))
    claim(db, "w2")
    run_since(db, cpu_job, 1.0)
    with db.write() as s:
        assert jobs.requeue(s, job_id=cpu_job, worker_id="w2", rule=hours)
    now = database_now(db)
    index, used = window_row(db, "alice")
    assert index == index_at(now, HOUR)
    assert used == pytest.approx(min(1.0, into(now, HOUR)), abs=1)

    # Within one window, a second run adds to the count.
    claim(db, "w3")
    run_since(db, cpu_job, 10.0)
    with db.write() as s:
        assert jobs.finish(s, job_id=cpu_job, worker_id="w3", status="succeeded", rule=hours)
    now = database_now(db)
    before = used if index_at(now, HOUR) == index else 0.0  # unless an hour turned meanwhile
    index, used = window_row(db, "alice")
    assert used == pytest.approx(before + min(10.0, into(now, HOUR)), abs=1)


def into(instant: datetime, length: float) -> float:
    return (instant - window_start(instant, length)).total_seconds()


def status(db: Database, job_id: int) -> str:
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job.status


def test_an_owner_who_spent_the_budget_waits_for_the_next_window(db: Database) -> None:
    at = mid_window(db)
    spend(db, "alice", 2 * HOUR, index_at(at))  # all of it, this window
    (alices,) = make_jobs(db, 1, owner="alice", priority=90)  # priority does not help
    (bobs,) = make_jobs(db, 1, owner="bob")
    with db.read() as s:
        places = {p.job_id: p for p in fairshare.queue(s, BUDGET, at=at)}
    assert places[alices].reason == "budget" and places[alices].position is None
    assert places[bobs].position == 1 and places[bobs].reason == "next"
    assert claim(db, "w1", rule=BUDGET, at=at).job_id == bobs  # type: ignore[union-attr]
    assert claim(db, "w2", rule=BUDGET, at=at) is None  # the slot stays free
    # Without a budget, the same database gives alice the slot.
    assert fairshare.Rule().has_budget is False
    # The next window starts her from nothing.
    next_window = window_start(at) + timedelta(seconds=WEEK, hours=1)
    with db.read() as s:
        places = {p.job_id: p for p in fairshare.queue(s, BUDGET, at=next_window)}
    assert places[alices].position == 1
    assert claim(db, "w2", rule=BUDGET, at=next_window).job_id == alices  # type: ignore[union-attr]


def test_a_running_job_spends_the_budget_while_it_runs(db: Database) -> None:
    at = mid_window(db)
    (running, waiting) = make_jobs(db, 2, owner="alice")
    claim(db, "w1", at=at)
    with db.write() as s:  # one and a half hours in, on the instant the order is taken at
        s.execute(update(Job).where(Job.id == running).values(accrued_at=at - timedelta(hours=1.5)))
    with db.read() as s:
        (place,) = fairshare.queue(s, BUDGET, at=at)
        assert place.job_id == waiting and place.position == 1
        later = at + timedelta(hours=0.5, seconds=1)  # 2 h and a second: spent
        (place,) = fairshare.queue(s, BUDGET, at=later)
        assert place.reason == "budget"
        (share,) = [x for x in fairshare.shares(s, BUDGET, at=later) if x.owner == "alice"]
    assert share.spent == pytest.approx(2 * HOUR + 1, abs=1)
    assert claim(db, "w2", rule=BUDGET, at=later) is None
    # The running job is not stopped: it is still alice's and still running.
    assert status(db, running) == "running"


def test_a_job_whose_worker_vanished_is_reclaimed_even_over_budget(db: Database) -> None:
    at = mid_window(db)
    (job_id,) = make_jobs(db, 1, owner="alice")
    claim(db, "w1")
    spend(db, "alice", 10 * HOUR, index_at(at))
    age_lease(db, job_id, 3600)
    got = claim(db, "w2", rule=BUDGET, at=at)
    assert got is not None and got.job_id == job_id and got.attempt == 2


def test_an_owner_out_of_budget_never_preempts(db: Database) -> None:
    at = mid_window(db)
    (long_run,) = make_jobs(db, 1, owner="alice")
    claim(db, "w1")
    with db.write() as s:  # alice's run has lasted an hour; bob's job has waited a minute
        s.execute(update(Job).where(Job.id == long_run).values(accrued_at=at - timedelta(hours=1)))
    (bobs,) = make_jobs(db, 1, owner="bob", priority=90)
    with db.write() as s:
        s.execute(update(Job).where(Job.id == bobs).values(updated_at=at - timedelta(minutes=1)))
    rule = preemption.Rule(after=600, wait=10, fair=BUDGET)
    with db.read() as s:
        asked = preemption.choose(s, rule, at=at)
    assert asked is not None and asked.by_job == bobs  # within budget: it may
    spend(db, "bob", 2 * HOUR, index_at(at))
    with db.read() as s:
        assert preemption.choose(s, rule, at=at) is None


@pytest.fixture
def budget_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"budget_slot_hours": 2.0})


def test_the_api_and_cli_show_the_window_and_the_reason(
    db: Database, budget_settings: Settings, team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    from service.api.app import create_app

    spend(db, "alice", 3 * HOUR, index_at(database_now(db)))
    with TestClient(create_app(budget_settings, db, auth=True)) as client:
        alice = Api(client, team.alice)
        job_id = alice.post("/v1/jobs", json={"name": "over"}).json()["id"]
        spot = alice.get(f"/v1/jobs/{job_id}").json()["queue"]
        assert spot["reason"] == "budget" and spot["position"] is None
        (item,) = alice.get("/v1/queue").json()["items"]
        assert item["reason"] == "budget"
        shares = Api(client, team.admin).get("/v1/users/shares").json()
    assert shares["budget_seconds"] == 2 * HOUR and shares["window_seconds"] == WEEK
    by_owner = {s["owner"]: s for s in shares["items"]}
    assert by_owner["alice"]["window_spent_seconds"] == pytest.approx(3 * HOUR)
    assert by_owner["bob"]["window_spent_seconds"] == 0.0

    monkeypatch.setenv("HALFWAY_HOME", str(budget_settings.home))
    monkeypatch.setenv("HALFWAY_DATABASE_URL", budget_settings.resolved_database_url())
    monkeypatch.setenv("HALFWAY_BUDGET_SLOT_HOURS", "2")
    printed = CliRunner().invoke(cli.app, ["users", "shares"])
    assert printed.exit_code == 0, printed.output
    (line,) = [row for row in printed.stdout.splitlines() if row.startswith("alice")]
    assert line.split()[-1] == "3.00"  # slot-hours this window
    assert "2 slot-hours" in printed.stderr
