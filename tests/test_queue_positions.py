"""Queue positions are the claim order (service/scheduling/fairshare.py ``queue``), while jobs come
and go: seeded random runs of submit / claim / finish / cancel / reweigh, on both databases, with
and without a per-user cap. After each step, the positions listed must be exactly the order in
which repeated claims at that instant then take the jobs (tried in a transaction that is
rolled back), and the reasons must say what is ahead."""

from __future__ import annotations

import random
from datetime import datetime

import pytest
from sqlalchemy import select

from service.database.db import Database
from service.database.dbclock import db_now
from service.database.models import Job, utcnow
from service.people import auth
from service.scheduling import fairshare, jobs
from service.specs.schemas import JobSpec, SubmitResult

OWNERS = ("ada", "bo", "cy", "di")
PRIORITIES = (40, 50, 50, 50, 60)


def submit(db: Database, rng: random.Random) -> None:
    owner = rng.choice(OWNERS)
    spec = JobSpec.model_validate({"name": owner, "priority": rng.choice(PRIORITIES)})
    with db.write() as s:
        jobs.create_job(
            s, owner=owner, submitted=SubmitResult(spec=spec, warnings=[], notes=[]), now=utcnow()
        )


def ids(db: Database, status: str) -> list[int]:
    with db.read() as s:
        return list(s.scalars(select(Job.id).where(Job.status == status).order_by(Job.id)))


def step(db: Database, rng: random.Random, cap: int) -> None:
    action = rng.choice(
        ("submit", "submit", "submit", "claim", "claim", "finish", "cancel", "weigh")
    )
    if action == "submit":
        submit(db, rng)
    elif action == "claim":
        with db.write() as s:
            jobs.claim_next(
                s,
                worker_id="w",
                lease_seconds=60,
                gpus_held=0,
                rule=fairshare.Rule(max_running_per_user=cap),
            )
    elif action == "finish" and (running := ids(db, "running")):
        with db.write() as s:
            jobs.finish(s, job_id=rng.choice(running), worker_id="w", status="succeeded")
    elif action == "cancel" and (queued := ids(db, "queued")):
        with db.write() as s:
            jobs.request_cancel(s, rng.choice(queued), utcnow())
    elif action == "weigh":
        with db.write() as s:
            fairshare.set_weight(s, rng.choice(OWNERS), rng.choice((0.5, 1.0, 2.0)))


def claims_at(db: Database, instant: datetime, cap: int) -> list[int]:
    """The jobs repeated claims take at ``instant``, in order; nothing is kept."""
    taken = []
    with db.write_sessions() as s, s.begin():
        while (
            c := jobs.claim_next(
                s,
                worker_id="probe",
                lease_seconds=60,
                gpus_held=0,
                rule=fairshare.Rule(max_running_per_user=cap),
                at=instant,
            )
        ) is not None:
            taken.append(c.job_id)
        s.rollback()
    return taken


def check(db: Database, cap: int) -> None:
    with db.read() as s:
        instant = s.scalar(select(db_now()))
        assert instant is not None
        places = fairshare.queue(s, fairshare.Rule(max_running_per_user=cap), at=instant)
    numbered = [p for p in places if p.position is not None]
    assert [p.position for p in numbered] == list(range(1, len(numbered) + 1))
    assert [p.job_id for p in numbered] == claims_at(db, instant, cap)
    for i, p in enumerate(numbered):
        ahead = numbered[:i]
        assert p.ahead == i
        if i == 0:
            assert p.reason == "next"
        elif p.reason == "priority":
            assert any(q.priority > p.priority for q in ahead)
        elif p.reason == "share":
            assert not any(q.priority > p.priority for q in ahead)
            assert any(q.owner != p.owner for q in ahead)
        else:
            assert p.reason == "age"
            assert not any(q.priority > p.priority for q in ahead)
    for p in places:
        if p.position is None:
            assert p.reason == "per-user cap" and cap > 0


@pytest.mark.parametrize(("seed", "cap"), [(1, 0), (2, 2), (3, 0)])
def test_positions_are_the_order_repeated_claims_take(db: Database, seed: int, cap: int) -> None:
    rng = random.Random(seed)
    with db.write() as s:
        for owner in OWNERS:
            auth.add_user(s, owner)
    for _ in range(40):
        step(db, rng, cap)
        check(db, cap)
    assert ids(db, "succeeded"), "the run finished no job: it tried too little"
