"""Preemption at checkpoints (service/scheduling/preemption.py), on both databases: the rule at the
SQL level (which running job is asked to stop for which waiting one, and when none is), one
request per waiting job however many supervisors ask at once, what a stop records, and a
crash of the preempting path; then real Keras children: a preempted job that resumes
exactly, a child killed during the stop, and the issue's one-slot scenario."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from rich.console import Console
from sqlalchemy import select, update

from service.client import tables
from service.database.db import Database
from service.database.dbclock import db_now
from service.database.models import Job, UserUsage, utcnow
from service.scheduling import fairshare, jobs, preemption
from service.settings import Settings
from tests.conftest import BACKENDS, Api, Team
from tests.reference import expected_scales
from tests.test_claims import age_lease, claim, make_jobs
from tests.test_fair_share import start_order
from tests.test_training_keras import all_history, submit
from tests.waiting import eventually
from workers.launchers import LocalHandle
from workers.supervisor import Supervisor

RULE = preemption.Rule(after=60, wait=10)


def used(db: Database, owner: str, seconds: float) -> None:
    """``owner`` has used ``seconds`` of slot time recently (as of the database's now)."""
    with db.write() as s:
        s.add(UserUsage(owner=owner, weight=1.0, usage_seconds=seconds, as_of=utcnow()))
        s.flush()
        s.execute(update(UserUsage).where(UserUsage.owner == owner).values(as_of=db_now()))


def running(db: Database, owner: str, ran: float, worker: str, **spec: Any) -> int:
    """A job of ``owner`` that ``worker`` has run for ``ran`` seconds (database clock)."""
    (job_id,) = make_jobs(db, 1, owner=owner, **spec)
    with db.write() as s:
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(
                status="running",
                worker_id=worker,
                attempt=1,
                lease_expires_at=db_now(30),
                started_at=db_now(-ran),
                accrued_at=db_now(-ran),
            )
        )
    return job_id


def waiting(db: Database, owner: str, waited: float, **spec: Any) -> int:
    """A job of ``owner`` queued ``waited`` seconds ago."""
    (job_id,) = make_jobs(db, 1, owner=owner, **spec)
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job_id).values(updated_at=db_now(-waited)))
    return job_id


def marks(db: Database) -> dict[int, int | None]:
    with db.read() as s:
        rows = s.execute(select(Job.id, Job.preempt_for).where(Job.status == "running")).all()
    return {job_id: for_job for job_id, for_job in rows}


def ask(db: Database, rule: preemption.Rule = RULE) -> preemption.Request | None:
    with db.write() as s:
        return preemption.request(s, rule)


def test_a_job_far_below_its_share_stops_the_job_of_the_owner_furthest_over_theirs(
    db: Database,
) -> None:
    used(db, "alice", 1000)
    used(db, "carol", 400)
    alices = running(db, "alice", 120, "w1")
    carols = running(db, "carol", 200, "w2")  # longer running, but carol stands lower
    bobs = waiting(db, "bob", 20)
    assert ask(db) == preemption.Request(job_id=alices, by_job=bobs, reason="share")
    assert marks(db) == {alices: bobs, carols: None}
    # Bob's job has its request: nothing more is asked for it.
    assert ask(db) is None
    assert marks(db) == {alices: bobs, carols: None}


def test_among_equals_the_longest_running_job_is_asked(db: Database) -> None:
    used(db, "bob", 0)
    shorter = running(db, "alice", 100, "w1")
    longer = running(db, "alice", 300, "w2")
    bobs = waiting(db, "bob", 20)
    assert ask(db) == preemption.Request(job_id=longer, by_job=bobs, reason="share")
    assert marks(db) == {shorter: None, longer: bobs}


def test_a_higher_priority_stops_a_job_of_the_same_owner(db: Database) -> None:
    job = running(db, "alice", 120, "w1")
    urgent = waiting(db, "alice", 20, priority=90)
    assert ask(db) == preemption.Request(job_id=job, by_job=urgent, reason="priority")


# Each case changes one thing from a setup in which bob's waiting job takes alice's slot:
# alice has used 1000 s and her job has run 120 s (standing 1120); bob has used 500 s
# (500 <= 1120 / 2), waited 20 s.
CASES: dict[str, tuple[dict[str, Any], Callable[[preemption.Rule], preemption.Rule]]] = {
    "not preemptible": ({"spec": {"preemptible": False}}, lambda r: r),
    "too young": ({"ran": 50}, lambda r: r),
    "preemption off": ({}, lambda r: preemption.Rule(enabled=False, after=r.after, wait=r.wait)),
    "not far enough below": ({"bob_used": 600}, lambda r: r),  # 600 > 1120 / 2
    "waited too little": ({"waited": 2}, lambda r: r),
    "same owner, same priority": ({"waiter": "alice"}, lambda r: r),
    "needs more GPUs than the job holds": ({"wspec": {"resources": {"gpus": 1}}}, lambda r: r),
    "lower priority": ({"wspec": {"priority": 40}}, lambda r: r),
    "the owner is at the per-user cap": (
        {"bob_runs": True},
        lambda r: preemption.Rule(
            after=r.after, wait=r.wait, fair=fairshare.Rule(max_running_per_user=1)
        ),
    ),
}


def setup(db: Database, change: dict[str, Any]) -> tuple[int, int]:
    used(db, "alice", 1000)
    used(db, "bob", change.get("bob_used", 500))
    job = running(db, "alice", change.get("ran", 120), "w1", **change.get("spec", {}))
    if change.get("bob_runs"):
        running(db, "bob", 1, "w2", preemptible=False)
    w = waiting(
        db, change.get("waiter", "bob"), change.get("waited", 20), **change.get("wspec", {})
    )
    return job, w


def test_the_unchanged_setup_does_stop_alice_s_job(db: Database) -> None:
    job, w = setup(db, {})
    assert ask(db) == preemption.Request(job_id=job, by_job=w, reason="share")


@pytest.mark.parametrize("case", CASES)
def test_no_job_is_asked_to_stop_when(db: Database, case: str) -> None:
    change, rule = CASES[case]
    setup(db, change)
    assert ask(db, rule(RULE)) is None
    assert not any(marks(db).values())


def test_two_supervisors_asking_at_once_ask_one_job_for_one_waiting_job(db_url: str) -> None:
    one, two = Database.connect(db_url), Database.connect(db_url)
    try:
        alices = running(one, "alice", 120, "w1")
        carols = running(one, "carol", 120, "w2")
        bobs = waiting(one, "bob", 20)
        # Two hosts each pick a different victim for bob's job (as they might with snapshots
        # a moment apart); the first request is not committed yet when the second is made.
        second: list[bool] = []
        with one.write() as s:
            assert preemption.mark(s, preemption.Request(alices, bobs, "share"), RULE)
            thread = threading.Thread(
                target=lambda: second.append(
                    _mark_in(two, preemption.Request(carols, bobs, "share"))
                )
            )
            thread.start()
            thread.join(timeout=0.5)  # usually still waiting for the first: the point
        thread.join(timeout=60)
        assert second == [False]
        assert marks(one) == {alices: bobs, carols: None}
        # And two supervisors deciding at once, from scratch, for another waiting job.
        (danas,) = make_jobs(one, 1, owner="dana")
        with one.write() as s:
            s.execute(update(Job).where(Job.id == danas).values(updated_at=db_now(-20)))
        results: list[preemption.Request | None] = []
        start = threading.Barrier(2)

        def decide(db: Database) -> None:
            start.wait()
            results.append(ask(db))

        threads = [threading.Thread(target=decide, args=(d,)) for d in (one, two)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(results, key=str) == [None, preemption.Request(carols, danas, "share")]
        assert marks(one) == {alices: bobs, carols: danas}
    finally:
        one.dispose()
        two.dispose()


def _mark_in(db: Database, request: preemption.Request) -> bool:
    with db.write() as s:
        return preemption.mark(s, request, RULE)


def test_a_request_for_a_job_that_no_longer_waits_is_dropped(db: Database) -> None:
    job = running(db, "alice", 120, "w1")
    w = waiting(db, "bob", 20)
    assert ask(db) is not None
    with db.write() as s:
        assert preemption.pending(s, job_id=job, worker_id="w1") == preemption.Request(
            job, w, "share"
        )
        assert preemption.pending(s, job_id=job, worker_id="someone-else") is None
    assert claim(db, "another-slot") is not None  # bob's job started elsewhere
    with db.write() as s:
        assert preemption.pending(s, job_id=job, worker_id="w1") is None
    assert marks(db) == {job: None, w: None}


def test_a_stopped_run_goes_back_with_its_attempt_and_the_preemption_recorded(
    db: Database,
) -> None:
    job = running(db, "alice", 120, "w1")
    w = waiting(db, "bob", 20)
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job).values(checkpoint_step=400))
    asked = ask(db)
    assert asked is not None
    with db.write() as s:  # what the supervisor does once its child has stopped
        assert preemption.record(s, job_id=job, worker_id="w1", request=asked)
        assert jobs.requeue(s, job_id=job, worker_id="w1", count_attempt=False)
    with db.read() as s:
        row = s.get(Job, job)
        assert row is not None
        assert (row.status, row.attempt, row.preempt_for) == ("queued", 0, None)
        (entry,) = row.preemptions
        assert {k: entry[k] for k in ("by_job", "reason", "step")} == {
            "by_job": w,
            "reason": "share",
            "step": 400,
        }
        assert any(f"preempted for job {w}" in note for note in row.notes)
    # The slot's next claim takes the job the stop made room for.
    assert claim(db, "w1").job_id == w  # type: ignore[union-attr]


def test_a_supervisor_that_dies_after_the_request_leaves_a_resumable_job(db: Database) -> None:
    # (A vanished worker's run stops counting as use: alice's recorded use orders the claims.)
    used(db, "alice", 1000)
    job = running(db, "alice", 120, "w1")
    w = waiting(db, "bob", 20)
    assert ask(db) is not None
    age_lease(db, job, 60)  # w1 is gone: its lease runs out with the request unanswered
    with db.write() as s:
        jobs.expire_abandoned(s)
    assert claim(db, "w2").job_id == w  # type: ignore[union-attr]
    again = claim(db, "w3")
    assert again is not None and again.job_id == job
    with db.read() as s:
        row = s.get(Job, job)
        assert row is not None
        assert (row.status, row.worker_id, row.preempt_for, row.attempt) == (
            "running",
            "w3",
            None,
            2,  # the lost worker's attempt counts, as any crash's does
        )


def test_the_job_answer_and_halfway_show_carry_the_preemptions(api: Api, db: Database) -> None:
    job_id = api.post("/v1/jobs", json={"name": "long"}).json()["id"]
    assert api.get(f"/v1/jobs/{job_id}").json()["preemptions"] == []
    entry = {"at": utcnow().isoformat(), "by_job": 7, "reason": "priority", "step": 1200}
    with db.write() as s:
        s.execute(update(Job).where(Job.id == job_id).values(preemptions=[entry]))
    # Written behind the API's back: the poll cache's snapshot ages first, as for a client.
    answer = eventually(lambda: api.get(f"/v1/jobs/{job_id}").json(), lambda j: j["preemptions"])
    got = answer["preemptions"]
    assert [(p["by_job"], p["reason"], p["step"]) for p in got] == [(7, "priority", 1200)]
    console = Console(width=200, record=True)
    console.print(tables.job_details(answer))
    assert "for job 7 (priority); at step 1200" in console.export_text()


# ---------------------------------------------------------------------------------------------
# Real Keras: the supervisor's spawned children, TensorFlow on the CPU.

TINY = {
    "data": {"samples": 640, "features": 16, "classes": 4},
    "model": {"input_size": 16, "hidden": [8], "num_classes": 4},
    "training": {"epochs": 1, "batch_size": 32, "steps_per_execution": 5},
}


# Long enough that bob's job preempts alice's before her second overflow even where a step
# takes a millisecond: with 2,000 steps, a float16 job on a CPU whose float16 runs at
# float32's pace once finished before the preemption came.
LONG_EPOCHS = 60
LONG_STEPS = LONG_EPOCHS * 100


def long_spec(epochs: int, overflows: list[int]) -> dict[str, Any]:
    """A job that runs long enough to be preempted (100 steps an epoch), checkpointing every
    200 steps, its scale growing every 150 clean steps so that growths straddle the pause."""
    return {
        "data": {"samples": 3200, "features": 16, "classes": 4},
        "model": {"input_size": 16, "hidden": [16], "num_classes": 4},
        "training": {
            "epochs": epochs,
            "batch_size": 32,
            "steps_per_execution": 10,
            "checkpoint_every": 200,
        },
        "loss_scale": {"growth_steps": 150},
        "faults": {"nonfinite_at_steps": overflows},
    }


def preempting(settings: Settings) -> Settings:
    """A slot that preempts at once: no minimum run, no minimum wait."""
    return settings.model_copy(update={"preempt_after": 0.0, "preempt_wait": 0.0})


def job_of(api: Api, job_id: int) -> dict[str, Any]:
    answer: dict[str, Any] = api.get(f"/v1/jobs/{job_id}").json()
    return answer


def until(api: Api, job_id: int, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll the job until ``ok``; fails after a generous bound (TensorFlow starts slowly on a
    loaded machine), which no assertion depends on."""
    return eventually(lambda: job_of(api, job_id), ok, timeout=300)


def over(job: dict[str, Any]) -> bool:
    return job["status"] not in ("queued", "running")


def check_exact_history(api: Api, job: dict[str, Any], overflows: list[int]) -> None:
    rows = all_history(api, job["id"])
    total = job["progress"]["total_steps"]
    assert [r["step"] for r in rows] == list(range(total))  # none lost, none twice
    assert set(overflows) <= {r["step"] for r in rows if not r["finite"]}
    assert [r["loss_scale"] for r in rows] == expected_scales(
        [r["finite"] for r in rows], growth_steps=150
    )


@pytest.mark.keras
def test_a_preempted_keras_job_resumes_exactly_and_records_the_preemption(
    api: Api, team: Team, db: Database, settings: Settings
) -> None:
    overflows = [30, LONG_STEPS - 40]
    long_id = submit(api, long_spec(LONG_EPOCHS, overflows))  # alice's
    with slot(db, preempting(settings)):
        until(api, long_id, lambda j: (j["summary"]["last_step"] or 0) >= 100)
        bobs = submit(api.as_user(team.bob), TINY)  # bob has used nothing: far below alice
        short = until(api, bobs, over)
        long = until(api, long_id, over)
    assert short["status"] == "succeeded", short["error"]
    assert long["status"] == "succeeded", long["error"]
    assert long["attempt"] == 1, long["attempt_errors"]  # the pause spent no attempt
    (entry,) = long["preemptions"]
    assert (entry["by_job"], entry["reason"]) == (bobs, "share")
    # It stopped between the two injected overflows, at a checkpoint written on the stop.
    assert overflows[0] < entry["step"] < overflows[1]
    assert short["started_at"] >= entry["at"] and short["finished_at"] <= long["finished_at"]
    check_exact_history(api, long, overflows)
    # The stop checkpointed the last step it recorded: no row was rewritten.
    assert long["history_version"] == 0
    assert any(f"preempted for job {bobs}" in note for note in long["notes"])


@pytest.mark.keras
def test_a_child_killed_during_the_preemption_stop_leaves_a_job_that_resumes_exactly(
    api: Api, team: Team, db: Database, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stop's SIGTERM becomes a SIGKILL: no checkpoint on the stop, rows past the last
    # acknowledged checkpoint were written and must be replaced by the resumed attempt's.
    monkeypatch.setattr(LocalHandle, "stop", LocalHandle.kill)
    overflows = [30, LONG_STEPS - 40]
    long_id = submit(api, long_spec(LONG_EPOCHS, overflows))
    with slot(db, preempting(settings)):
        until(api, long_id, lambda j: (j["summary"]["checkpoint_step"] or 0) >= 200)
        bobs = submit(api.as_user(team.bob), TINY)
        short = until(api, bobs, over)
        long = until(api, long_id, over)
    assert short["status"] == "succeeded", short["error"]
    assert long["status"] == "succeeded", long["error"]
    assert long["attempt"] == 1, long["attempt_errors"]
    (entry,) = long["preemptions"]
    assert entry["by_job"] == bobs and entry["step"] % 200 == 0 and entry["step"] >= 200
    check_exact_history(api, long, overflows)
    # Rows the child had sent past the checkpoint (if it sent any before it died) were
    # replaced, and only then did the version move.
    assert long["history_version"] in (0, 1)
    if long["history_version"] == 1:
        assert long["history_reset_step"] == entry["step"]


@pytest.mark.keras
def test_a_preemption_whose_checkpoint_cannot_reach_the_store_leaves_a_job_that_resumes_exactly(
    api: Api, team: Team, db: Database, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store goes down once the job is asked to stop: the stop's checkpoint (and any
    # other from then on) is not stored, so the job must go back to the queue from its last
    # acknowledged checkpoint and replace the rows past it.
    overflows = [30, LONG_STEPS - 40]
    long_id = submit(api, long_spec(LONG_EPOCHS, overflows))
    failed: list[int] = []
    store = LocalHandle.commit_checkpoint

    def store_down_once_asked(handle: LocalHandle, step: int) -> None:
        with db.read() as s:
            asked = s.scalar(select(Job.preempt_for).where(Job.id == long_id))
        if asked is not None:
            failed.append(step)
            raise OSError("the store is down")
        store(handle, step)

    monkeypatch.setattr(LocalHandle, "commit_checkpoint", store_down_once_asked)
    with slot(db, preempting(settings)):
        until(api, long_id, lambda j: (j["summary"]["checkpoint_step"] or 0) >= 200)
        bobs = submit(api.as_user(team.bob), TINY)
        short = until(api, bobs, over)
        long = until(api, long_id, over)
    assert failed, "no checkpoint was refused: the test did not test what it says"
    assert short["status"] == "succeeded", short["error"]
    assert long["status"] == "succeeded", long["error"]
    assert long["attempt"] == 1, long["attempt_errors"]
    (entry,) = long["preemptions"]
    # It resumed from the last checkpoint stored before the store went down.
    assert entry["by_job"] == bobs and entry["step"] % 200 == 0 and entry["step"] < failed[0]
    check_exact_history(api, long, overflows)
    assert long["history_version"] in (0, 1)
    if long["history_version"] == 1:
        assert long["history_reset_step"] == entry["step"]


# Eight real Keras trainings in a row (a minute and a half): on one database, the team's
# (PostgreSQL) where the suite has it; the fake-trainer scenario runs on both
# (test_fair_share.py) and the real-Keras resumes above on both.
ONE_DATABASE = ["postgresql" if "postgresql" in BACKENDS else "sqlite"]


@pytest.mark.keras
@pytest.mark.parametrize("db_url", ONE_DATABASE, indirect=True)
def test_one_keras_slot_the_second_member_s_jobs_start_before_the_first_member_s_last_three(
    api: Api, team: Team, db: Database, settings: Settings
) -> None:
    alices = [submit(api, long_spec(15, []))] + [submit(api, TINY) for _ in range(5)]
    with slot(db, preempting(settings)):
        # "A moment later": alice's first job is training (a job stopped while TensorFlow
        # still starts would lose only the start, but would also make the run longer).
        until(api, alices[0], lambda j: (j["summary"]["last_step"] or 0) >= 100)
        bobs = [submit(api.as_user(team.bob), TINY) for _ in range(2)]
        done = [until(api, j, over) for j in alices + bobs]
    assert {j["status"] for j in done} == {"succeeded"}, [j["error"] for j in done]
    assert all(j["attempt"] == 1 for j in done)
    order = start_order(db, alices + bobs)
    assert order[0] == alices[0]
    assert max(order.index(j) for j in bobs) < min(order.index(j) for j in alices[3:]), order
    # Bob did not wait for alice's long first job: it was preempted for his first.
    first = done[0]
    assert bobs[0] in [p["by_job"] for p in first["preemptions"]]
    assert done[6]["started_at"] < first["finished_at"]
    check_exact_history(api, first, [])


@contextmanager
def slot(db: Database, settings: Settings) -> Iterator[Supervisor]:
    """One training slot: a real supervisor running jobs until the block ends."""
    supervisor = Supervisor(db, settings, worker_id="the-slot")
    thread = threading.Thread(target=supervisor.run_forever, daemon=True)
    thread.start()
    try:
        yield supervisor
    finally:
        supervisor.stop()
        thread.join(timeout=120)
