"""Fair share by recent use (service/scheduling/fairshare.py), on both databases: one slot shared
by two members through the real supervisor path with fake trainers, two supervisors with their own
connections agreeing on the order from the database alone, usage accrual and decay, weights,
and the API and CLI that show them."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import select, update
from typer.testing import CliRunner

from service import cli
from service.client import tables
from service.database.db import Database
from service.database.dbclock import db_now
from service.database.models import Job, UserUsage, utcnow
from service.scheduling import fairshare, jobs
from service.settings import Settings
from service.specs.schemas import JobSpec, SubmitResult
from tests import fakes
from tests.conftest import Api, Team
from tests.test_claims import claim, make_jobs
from workers.supervisor import Supervisor

# Each fake job takes about the same time (a step every 50 ms), so that the usage a job adds
# is much the same whoever owns it.
SLOW = {"mode": "slow", "steps": 4, "interval": 0.05}


def queue_fake_jobs(db: Database, owner: str, n: int, fake: dict[str, Any]) -> list[int]:
    ids = []
    with db.write() as s:
        for i in range(n):
            submitted = SubmitResult(
                spec=JobSpec.model_validate({"name": f"{owner}-{i}"}), warnings=[], notes=[]
            )
            job = jobs.create_job(s, owner=owner, submitted=submitted, now=utcnow())
            job.spec = {**job.spec, "fake": fake}
            ids.append(job.id)
    return ids


def start_order(db: Database, ids: list[int]) -> list[int]:
    with db.read() as s:
        rows = s.execute(select(Job.id, Job.started_at).where(Job.id.in_(ids))).all()
    started = {job_id: at for job_id, at in rows if at is not None}
    assert len(started) == len(ids)
    return sorted(started, key=started.__getitem__)


def usage_of(db: Database, owner: str) -> float:
    with db.read() as s:
        row = s.get(UserUsage, owner)
        return 0.0 if row is None else row.usage_seconds


def test_one_slot_the_second_member_s_jobs_start_before_the_first_member_s_last_three(
    db: Database, settings: Settings
) -> None:
    supervisor = Supervisor(db, settings, trainer=fakes.trainer, worker_id="the-slot")
    a = queue_fake_jobs(db, "alice", 6, SLOW)
    thread = threading.Thread(target=supervisor.run_forever, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # "a moment later": alice's first job runs
            with db.read() as s:
                if s.get(Job, a[0]).status != "queued":  # type: ignore[union-attr]
                    break
            time.sleep(0.02)
        b = queue_fake_jobs(db, "bob", 2, SLOW)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with db.read() as s:
                done = s.scalar(
                    select(Job.id).where(Job.status.in_(("queued", "running"))).limit(1)
                )
            if done is None:
                break
            time.sleep(0.1)
    finally:
        supervisor.stop()
        thread.join(timeout=30)
    with db.read() as s:
        assert {j.status for j in s.scalars(select(Job))} == {"succeeded"}
    order = start_order(db, a + b)
    assert order[0] == a[0]
    last_three_of_alice = min(order.index(j) for j in a[3:])
    assert max(order.index(j) for j in b) < last_three_of_alice, order
    # Each run's slot-seconds went to its owner, on the database's clock: an owner's usage is
    # the sum of their runs' times there. Not "alice's six runs outweigh bob's two": on a
    # loaded machine one slow run undid that in a full suite. PostgreSQL's now() is the
    # transaction's, so a run's end and its charge are one instant (a day's half-life takes
    # a ten-thousandth off over these seconds). SQLite reads its clock per statement: the
    # charge comes a statement after the end, a few milliseconds under load.
    with db.read() as s:
        runs = s.execute(
            select(Job.owner, Job.attempt, Job.started_at, Job.finished_at).where(Job.id.in_(a + b))
        ).all()
    assert {attempt for _, attempt, _, _ in runs} == {1}, "no job ran twice"
    seconds = {"alice": 0.0, "bob": 0.0}
    count = {"alice": 0, "bob": 0}
    for who, _, started, finished in runs:
        assert started is not None and finished is not None
        seconds[who] += (finished - started).total_seconds()
        count[who] += 1
    per_run_lag = 0.1 if db.engine.dialect.name == "sqlite" else 0.001
    for owner, ran in seconds.items():
        assert count[owner] and ran > 0, owner
        assert ran * (1 - 1e-3) <= usage_of(db, owner) <= ran + per_run_lag * count[owner], owner


def test_two_supervisors_with_their_own_connections_follow_one_order(
    db_url: str, settings: Settings
) -> None:
    one, two = Database.connect(db_url), Database.connect(db_url)
    try:
        first = Supervisor(one, settings, trainer=fakes.trainer, worker_id="host-1")
        second = Supervisor(two, settings, trainer=fakes.trainer, worker_id="host-2")
        a = queue_fake_jobs(one, "alice", 3, SLOW)
        b = queue_fake_jobs(one, "bob", 2, SLOW)
        c = queue_fake_jobs(one, "carol", 1, SLOW)
        assert first.run_once()  # alice's oldest: nobody has used anything
        # What host 1 accrued decides host 2's claim: alice has used the slot, bob and carol
        # have not; bob's job is older.
        with two.read() as s:
            predicted = fairshare.queue(s, fairshare.Rule())[0].job_id
        assert predicted == b[0]
        assert second.run_once()
        with one.read() as s:
            predicted = fairshare.queue(s, fairshare.Rule())[0].job_id
        assert predicted == c[0]  # carol alone has used nothing
        assert first.run_once()
        assert start_order(one, a[:1] + b[:1] + c) == [a[0], b[0], c[0]]
        with one.read() as s:
            by_host = {row[0]: row[1] for row in s.execute(select(Job.id, Job.worker_id))}
        assert (by_host[a[0]], by_host[b[0]], by_host[c[0]]) == ("host-1", "host-2", "host-1")
    finally:
        one.dispose()
        two.dispose()


def test_a_running_job_counts_while_it_runs(db: Database) -> None:
    (old,) = make_jobs(db, 1, owner="alice")
    (young,) = make_jobs(db, 1, owner="bob")
    (later,) = make_jobs(db, 1, owner="alice")
    instant = utcnow()
    assert claim(db, "w1", at=instant).job_id == old  # type: ignore[union-attr]
    # Ten minutes on, alice's running job has used ten slot-minutes; bob nothing.
    ten_minutes_on = instant + timedelta(minutes=10)
    with db.read() as s:
        places = fairshare.queue(s, fairshare.Rule(), at=ten_minutes_on)
    assert [p.job_id for p in places] == [young, later]
    assert places[1].usage == pytest.approx(600, abs=5)
    assert claim(db, "w2", at=ten_minutes_on).job_id == young  # type: ignore[union-attr]


def test_gpu_seconds_count_each_gpu(db: Database) -> None:
    (job_id,) = make_jobs(db, 1, owner="alice", resources={"gpus": 2})
    assert claim(db, "w", gpus=2) is not None
    with db.write() as s:  # the run started 100 s ago on the database's clock
        s.execute(update(Job).where(Job.id == job_id).values(accrued_at=db_now(-100)))
    with db.write() as s:
        assert jobs.finish(s, job_id=job_id, worker_id="w", status="succeeded")
    assert usage_of(db, "alice") == pytest.approx(200, abs=2)


def test_usage_decays_with_the_half_life_before_a_new_run_is_added(db: Database) -> None:
    with db.write() as s:  # 10 s of use recorded one half-life (an hour) ago
        s.add(UserUsage(owner="alice", weight=1.0, usage_seconds=10.0, as_of=utcnow()))
        s.flush()
        s.execute(update(UserUsage).values(as_of=db_now(-3600)))
    (job_id,) = make_jobs(db, 1, owner="alice")
    claim(db, "w")
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job_id).values(accrued_at=db_now(-4)))
    with db.write() as s:
        assert jobs.requeue(s, job_id=job_id, worker_id="w", rule=fairshare.Rule(half_life=3600))
    assert usage_of(db, "alice") == pytest.approx(5 + 4, abs=0.5)


def test_the_owner_furthest_below_their_share_goes_first_and_weights_scale_shares(
    db: Database, team: Team
) -> None:
    with db.write() as s:
        for owner, used in (("alice", 300.0), ("bob", 400.0)):
            s.add(UserUsage(owner=owner, weight=1.0, usage_seconds=used, as_of=utcnow()))
    (alices,) = make_jobs(db, 1, owner="alice")
    (bobs,) = make_jobs(db, 1, owner="bob")
    with db.read() as s:
        assert [p.job_id for p in fairshare.queue(s, fairshare.Rule())] == [alices, bobs]
    with db.write() as s:
        fairshare.set_weight(s, "bob", 2.0)  # 400 / 2 < 300 / 1
    with db.read() as s:
        assert [p.job_id for p in fairshare.queue(s, fairshare.Rule())] == [bobs, alices]
        by_owner = {share.owner: share for share in fairshare.shares(s, fairshare.Rule())}
    assert by_owner["bob"].share == pytest.approx(2 / 4)  # alice, bob and root: 1 + 2 + 1
    assert by_owner["bob"].standing == pytest.approx(200, rel=1e-3)
    assert by_owner["alice"].usage_share == pytest.approx(3 / 7, rel=1e-3)
    assert claim(db, "w").job_id == bobs  # type: ignore[union-attr]


def test_priority_still_beats_share(db: Database) -> None:
    with db.write() as s:
        s.add(UserUsage(owner="alice", weight=1.0, usage_seconds=1e6, as_of=utcnow()))
    make_jobs(db, 1, owner="bob")
    (urgent,) = make_jobs(db, 1, owner="alice", priority=90)
    assert claim(db, "w").job_id == urgent  # type: ignore[union-attr]


def test_the_api_shows_each_queued_job_s_place_and_why(api: Api, team: Team) -> None:
    alices = [api.post("/v1/jobs", json={"name": f"a{i}"}).json()["id"] for i in range(2)]
    bob = api.as_user(team.bob)
    bobs = bob.post("/v1/jobs", json={"name": "b0"}).json()["id"]
    urgent = bob.post("/v1/jobs", json={"name": "urgent", "priority": 90}).json()["id"]
    spots = {i: api.get(f"/v1/jobs/{i}").json()["queue"] for i in (*alices, bobs, urgent)}
    assert spots[urgent] == {"position": 1, "ahead": 0, "reason": "next"}
    assert spots[alices[0]] == {"position": 2, "ahead": 1, "reason": "priority"}
    # At equal use, alice runs none of hers when her second comes up, bob one (the urgent
    # one): her second goes before bob's, older or not.
    assert spots[alices[1]] == {"position": 3, "ahead": 2, "reason": "priority"}
    assert spots[bobs] == {"position": 4, "ahead": 3, "reason": "priority"}
    listed = {j["id"]: j["queue"] for j in api.get("/v1/jobs").json()["items"]}
    assert listed == spots
    queue = api.get("/v1/queue").json()
    assert [item["job_id"] for item in queue["items"]] == [urgent, *alices, bobs]
    assert [item["position"] for item in queue["items"]] == [1, 2, 3, 4]
    assert queue["items"][0]["owner"] == "bob" and queue["items"][0]["owner_weight"] == 1.0
    assert queue["half_life_seconds"] == 86400.0


def test_shares_are_for_admins_who_may_set_a_weight(api: Api, team: Team) -> None:
    assert api.get("/v1/users/shares").status_code == 403
    assert api.request("PUT", "/v1/users/bob/share", json={"weight": 3}).status_code == 403
    admin = api.as_user(team.admin)
    assert admin.request("PUT", "/v1/users/nobody/share", json={"weight": 3}).status_code == 404
    assert admin.request("PUT", "/v1/users/bob/share", json={"weight": 0}).status_code == 422
    answer = admin.request("PUT", "/v1/users/bob/share", json={"weight": 3})
    assert answer.status_code == 200
    shares = {s["owner"]: s for s in admin.get("/v1/users/shares").json()["items"]}
    assert shares["bob"]["weight"] == 3.0 and shares["bob"]["share"] == pytest.approx(0.6)
    assert shares["alice"]["usage_seconds"] == 0.0


def test_halfway_users_shares_prints_weights_and_usage(
    db: Database, settings: Settings, team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HALFWAY_HOME", str(settings.home))
    monkeypatch.setenv("HALFWAY_DATABASE_URL", settings.resolved_database_url())
    runner = CliRunner()
    set_weight = runner.invoke(cli.app, ["users", "share", "bob", "2.5"])
    assert set_weight.exit_code == 0, set_weight.output
    listed = runner.invoke(cli.app, ["users", "shares"])
    assert listed.exit_code == 0, listed.output
    line = next(line for line in listed.output.splitlines() if line.split()[:1] == ["bob"])
    assert "2.5" in line


def test_halfway_jobs_and_show_print_the_place(api: Api, team: Team) -> None:
    api.as_user(team.bob).post("/v1/jobs", json={"name": "first", "priority": 90})
    waiting = api.post("/v1/jobs", json={"name": "second"}).json()["id"]
    console = Console(width=200, record=True)
    console.print(tables.jobs_table(api.get("/v1/jobs").json()))
    row = next(line for line in console.export_text().splitlines() if "second" in line)
    assert "#2 priority" in row
    console.print(tables.job_details(api.get(f"/v1/jobs/{waiting}").json()))
    assert "#2, 1 ahead (higher-priority jobs ahead)" in console.export_text()


def test_a_sqlite_claim_works_in_a_process_that_has_imported_tensorflow(
    db: Database, db_url: str
) -> None:
    """TensorFlow bundles its own SQLite, built without the math functions (power()), and a
    process that imports it first binds every later SQLite connection to that build: the
    fair-share decay must not depend on the SQLite a process happens to load."""
    (job_id,) = make_jobs(db, 1)
    script = (
        "import sys, tensorflow\n"
        "from service.database.db import Database\n"
        "from tests.test_claims import claim\n"
        "got = claim(Database.connect(sys.argv[1]), 'w')\n"
        "print(got.job_id if got else None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, db_url], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(job_id)
