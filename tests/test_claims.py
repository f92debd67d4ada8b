"""Claiming, leases and fencing in the job state machine, on both databases."""

from __future__ import annotations

import threading
from datetime import timedelta

from service import jobs
from service.db import Database
from service.models import Job, utcnow
from service.schemas import JobSpec, SubmitResult


def make_jobs(db: Database, n: int, owner: str = "alice", **spec: object) -> list[int]:
    ids = []
    with db.write() as s:
        for i in range(n):
            submitted = SubmitResult(
                spec=JobSpec.model_validate({"name": f"{owner}-{i}", **spec}),
                warnings=[],
                notes=[],
            )
            ids.append(jobs.create_job(s, owner=owner, submitted=submitted, now=utcnow()).id)
    return ids


def claim(
    db: Database, worker: str, now: object = None, gpus: int = 0, **kw: object
) -> jobs.Claim | None:
    with db.write() as s:
        return jobs.claim_next(
            s,
            worker_id=worker,
            now=now or utcnow(),  # type: ignore[arg-type]
            lease_seconds=30,
            gpus_held=gpus,
            **kw,  # type: ignore[arg-type]
        )


def test_two_supervisors_racing_claim_each_job_exactly_once(db: Database) -> None:
    ids = make_jobs(db, 20)
    claimed: dict[str, list[int]] = {"a": [], "b": []}
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            barrier.wait()
            while (c := claim(db, name)) is not None:
                claimed[name].append(c.job_id)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    together = claimed["a"] + claimed["b"]
    assert sorted(together) == sorted(ids)
    assert len(set(together)) == 20
    with db.read() as s:
        rows = s.query(Job).all()
        assert all(j.status == "running" and j.attempt == 1 for j in rows)
        for name, got in claimed.items():
            assert all(s.get(Job, i).worker_id == name for i in got)  # type: ignore[union-attr]


def test_claim_order_is_priority_then_age(db: Database) -> None:
    low = make_jobs(db, 1, priority=10)[0]
    old = make_jobs(db, 1)[0]
    new = make_jobs(db, 1)[0]
    high = make_jobs(db, 1, priority=90)[0]
    order = [claim(db, "w").job_id for _ in range(4)]  # type: ignore[union-attr]
    assert order == [high, old, new, low]
    assert claim(db, "w") is None


def test_expired_lease_is_reclaimed_with_attempt_plus_one(db: Database) -> None:
    (job_id,) = make_jobs(db, 1)
    now = utcnow()
    first = claim(db, "dead", now=now)
    assert first is not None and first.attempt == 1
    assert claim(db, "other", now=now + timedelta(seconds=10)) is None  # lease still valid
    second = claim(db, "other", now=now + timedelta(seconds=31))
    assert second is not None and second.job_id == job_id and second.attempt == 2


def test_renewal_is_fenced_to_the_lease_holder(db: Database) -> None:
    (job_id,) = make_jobs(db, 1)
    now = utcnow()
    claim(db, "w1", now=now)
    with db.write() as s:
        assert (
            jobs.renew_lease(s, job_id=job_id, worker_id="w1", now=now, lease_seconds=30) is False
        )
        assert jobs.renew_lease(s, job_id=job_id, worker_id="w2", now=now, lease_seconds=30) is None
    # w1 vanished; w2 reclaims; w1's late renewal and finish are refused.
    later = now + timedelta(seconds=40)
    assert claim(db, "w2", now=later) is not None
    with db.write() as s:
        assert (
            jobs.renew_lease(s, job_id=job_id, worker_id="w1", now=later, lease_seconds=30) is None
        )
        assert not jobs.finish(s, job_id=job_id, worker_id="w1", status="succeeded", now=later)
        assert jobs.finish(s, job_id=job_id, worker_id="w2", status="succeeded", now=later)
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "succeeded" and job.lease_expires_at is None


def test_renewal_reports_a_cancel_request(db: Database) -> None:
    (job_id,) = make_jobs(db, 1)
    now = utcnow()
    claim(db, "w1", now=now)
    with db.write() as s:
        jobs.request_cancel(s, job_id, now)
    with db.write() as s:
        assert jobs.renew_lease(s, job_id=job_id, worker_id="w1", now=now, lease_seconds=30) is True


def test_abandoned_jobs_out_of_attempts_fail_and_cancelled_ones_end_cancelled(db: Database) -> None:
    spent, asked = make_jobs(db, 2, max_attempts=1)
    now = utcnow()
    claim(db, "gone", now=now)
    claim(db, "gone", now=now)
    with db.write() as s:
        jobs.request_cancel(s, asked, now)
    later = now + timedelta(seconds=60)
    with db.write() as s:
        assert jobs.expire_abandoned(s, later) == 2
    assert claim(db, "w", now=later) is None
    with db.read() as s:
        a, b = s.get(Job, spent), s.get(Job, asked)
        assert a is not None and a.status == "failed" and "lease expired" in (a.error or "")
        assert b is not None and b.status == "cancelled"


def test_requeue_puts_the_job_back_and_can_give_the_attempt_back(db: Database) -> None:
    (job_id,) = make_jobs(db, 1)
    now = utcnow()
    claim(db, "w", now=now)
    with db.write() as s:
        assert jobs.requeue(s, job_id=job_id, worker_id="w", now=now, count_attempt=False)
    again = claim(db, "w", now=now)
    assert again is not None and again.attempt == 1


def test_gpu_jobs_are_claimed_only_by_workers_holding_enough(db: Database) -> None:
    two = make_jobs(db, 1, resources={"gpus": 2})[0]
    cpu = make_jobs(db, 1, resources={"gpus": 0})[0]
    auto = make_jobs(db, 1)[0]
    assert claim(db, "cpu-worker", gpus=0).job_id == cpu  # type: ignore[union-attr]
    assert claim(db, "cpu-worker", gpus=0).job_id == auto  # type: ignore[union-attr]
    assert claim(db, "cpu-worker", gpus=0) is None
    assert claim(db, "one-gpu", gpus=1) is None
    assert claim(db, "two-gpus", gpus=2).job_id == two  # type: ignore[union-attr]
