"""Claiming, leases and fencing in the job state machine, on both databases."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import update

from service.database.db import Database
from service.database.dbclock import db_now
from service.database.models import Job, utcnow
from service.scheduling import jobs
from service.specs.schemas import JobSpec, SubmitResult


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


def claim(db: Database, worker: str, gpus: int = 0, **kw: object) -> jobs.Claim | None:
    with db.write() as s:
        return jobs.claim_next(
            s,
            worker_id=worker,
            lease_seconds=30,
            gpus_held=gpus,
            **kw,  # type: ignore[arg-type]
        )


def age_lease(db: Database, job_id: int, seconds: float) -> None:
    """Time passing for a lease, without sleeping: move its expiry ``seconds`` earlier, on
    the database's clock (the only one leases are read with)."""
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.lease_expires_at is not None
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(lease_expires_at=job.lease_expires_at - timedelta(seconds=seconds))
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
    first = claim(db, "dead")
    assert first is not None and first.attempt == 1
    age_lease(db, job_id, 10)
    assert claim(db, "other") is None  # lease still valid
    age_lease(db, job_id, 21)
    second = claim(db, "other")
    assert second is not None and second.job_id == job_id and second.attempt == 2


def test_renewal_is_fenced_to_the_lease_holder(db: Database) -> None:
    (job_id,) = make_jobs(db, 1)
    claim(db, "w1")
    with db.write() as s:
        renewed = jobs.renew_and_load(s, job_id=job_id, worker_id="w1", lease_seconds=30)
        assert renewed is not None and renewed.cancel_requested is False
        assert jobs.renew_and_load(s, job_id=job_id, worker_id="w2", lease_seconds=30) is None
    # w1 vanished; w2 reclaims; w1's late renewal, attempt error and finish are refused.
    age_lease(db, job_id, 40)
    assert claim(db, "w2") is not None
    with db.write() as s:
        assert jobs.renew_and_load(s, job_id=job_id, worker_id="w1", lease_seconds=30) is None
        assert not jobs.record_attempt_error(
            s, job_id=job_id, worker_id="w1", attempt=1, error="late"
        )
        assert not jobs.finish(s, job_id=job_id, worker_id="w1", status="succeeded")
        assert jobs.finish(s, job_id=job_id, worker_id="w2", status="succeeded")
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "succeeded" and job.lease_expires_at is None
        assert job.attempt_errors == []


def test_renewal_reports_a_cancel_request(db: Database) -> None:
    (job_id,) = make_jobs(db, 1)
    claim(db, "w1")
    with db.write() as s:
        jobs.request_cancel(s, job_id, utcnow())
    with db.write() as s:
        renewed = jobs.renew_and_load(s, job_id=job_id, worker_id="w1", lease_seconds=30)
        assert renewed is not None and renewed.cancel_requested is True


def test_abandoned_jobs_out_of_attempts_fail_and_cancelled_ones_end_cancelled(db: Database) -> None:
    spent, asked = make_jobs(db, 2, max_attempts=1)
    claim(db, "gone")
    claim(db, "gone")
    with db.write() as s:
        jobs.request_cancel(s, asked, utcnow())
    with db.write() as s:
        assert jobs.expire_abandoned(s) == 0  # both leases are live
    age_lease(db, spent, 60)
    age_lease(db, asked, 60)
    with db.write() as s:
        assert jobs.expire_abandoned(s) == 2
    assert claim(db, "w") is None
    with db.read() as s:
        a, b = s.get(Job, spent), s.get(Job, asked)
        assert a is not None and a.status == "failed" and "lease expired" in (a.error or "")
        assert b is not None and b.status == "cancelled"


def test_requeue_puts_the_job_back_and_can_give_the_attempt_back(db: Database) -> None:
    (job_id,) = make_jobs(db, 1)
    claim(db, "w")
    with db.write() as s:
        assert jobs.requeue(s, job_id=job_id, worker_id="w", count_attempt=False)
    again = claim(db, "w")
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


def test_leases_are_written_and_read_on_the_database_clock(db: Database) -> None:
    (job_id,) = make_jobs(db, 1)
    with db.read() as s:
        before = s.scalar(db_now().select())
    claimed = claim(db, "w")
    assert claimed is not None
    with db.read() as s:
        job = s.get(Job, job_id)
        after = s.scalar(db_now().select())
        assert job is not None and job.lease_expires_at is not None and job.started_at
        assert before is not None and after is not None
        assert before + timedelta(seconds=30) <= job.lease_expires_at
        assert job.lease_expires_at <= after + timedelta(seconds=30)
        assert before <= job.started_at <= after
