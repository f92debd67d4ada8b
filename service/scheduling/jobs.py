"""The job state machine. Every transition is one guarded UPDATE whose rowcount (or RETURNING
row) says whether it happened, so two actors racing on one job never both win.

queued -> running (claim) -> succeeded | failed | cancelled
queued -> cancelled (cancel before a worker took it)
running -> queued (retry after a crash, or a worker shutting down)
running (lease expired) -> running again under another worker (reclaim), up to max_attempts

Functions take a Session and flush; the caller owns the transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from service.database.dbclock import db_now
from service.database.models import FINISHED_STATUSES, Job
from service.errors import Conflict, NotFound
from service.scheduling import fairshare
from service.specs.schemas import SubmitResult


def create_job(
    session: Session,
    *,
    owner: str,
    submitted: SubmitResult,
    now: datetime,
    idempotency_key: str | None = None,
    body_hash: str | None = None,
    sweep_id: int | None = None,
) -> Job:
    spec = submitted.spec
    gpus = spec.resources.gpus
    job = Job(
        owner=owner,
        name=spec.name or "job",
        status="queued",
        spec=spec.model_dump(mode="json"),
        warnings=submitted.warnings,
        notes=submitted.notes,
        priority=spec.priority,
        gpus=None if gpus == "auto" else gpus,
        attempt=0,
        max_attempts=spec.max_attempts,
        cancel_requested=False,
        attempt_errors=[],
        idempotency_key=idempotency_key,
        body_hash=body_hash,
        sweep_id=sweep_id,
        created_at=now,
        updated_at=now,
        overflow_count=0,
        growth_count=0,
        backoff_count=0,
        nonfinite_loss_count=0,
        steps_recorded=0,
        overflows_recorded=0,
        backoffs_recorded=0,
        metrics={},
        precision_report=[],
        forensics=[],
        device={},
    )
    session.add(job)
    session.flush()
    return job


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"job {job_id} does not exist")
    return job


def find_by_idempotency_key(session: Session, owner: str, key: str) -> Job | None:
    return session.scalars(
        select(Job).where(Job.owner == owner, Job.idempotency_key == key)
    ).one_or_none()


def request_cancel(session: Session, job_id: int, now: datetime) -> Job:
    """Cancel a queued job at once; ask a running one's worker to stop it."""
    done = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "queued")
        .values(status="cancelled", finished_at=now, updated_at=now, cancel_requested=True)
    )
    if done.rowcount == 0:  # type: ignore[attr-defined]
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == "running")
            .values(cancel_requested=True, updated_at=now)
        )
    session.flush()
    job = get_job(session, job_id)
    session.refresh(job)
    if job.status in FINISHED_STATUSES and not (job.status == "cancelled" and job.cancel_requested):
        raise Conflict(f"job {job_id} already finished: {job.status}")
    return job


def set_priority(session: Session, job_id: int, priority: int, now: datetime) -> Job:
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == "queued")
        .values(priority=priority, updated_at=now)
    )
    job = get_job(session, job_id)
    if result.rowcount == 0:  # type: ignore[attr-defined]
        raise Conflict(f"job {job_id} is {job.status}; only a queued job's priority can change")
    session.refresh(job)
    return job


# --------------------------------------------------------------------------------------------
# Worker side


@dataclass(frozen=True)
class Claim:
    job_id: int
    attempt: int
    spec: dict[str, Any]
    checkpoint_step: int | None
    # The auto policy's pick of an earlier attempt, for the child to train with again.
    precision_decision: dict[str, Any] | None = None


# Every time below comes from the database's clock (db_now): a lease is compared with times
# that other hosts wrote, so a worker whose clock is off must neither steal a live lease nor
# write one that others see as expired. Tests drive expiry by writing lease_expires_at.


_claimable = fairshare.claimable


def claim_next(
    session: Session,
    *,
    worker_id: str,
    lease_seconds: float,
    gpus_held: int,
    rule: fairshare.Rule = fairshare.Rule(),
    skip_locked: bool = True,
    at: datetime | None = None,
) -> Claim | None:
    """Claim the next job in the fair-share order (``fairshare.claim_order``): highest
    priority, then the owner furthest below their share of recent use, then the owner with
    fewer running jobs, then the oldest, among owners under the per-user cap and within their
    budget (``rule``). Expired leases are reclaimed by the same query, budget or not.
    ``at`` computes the order as of that instant instead of the database's now (tests and
    benchmarks; leases always use the database's clock).

    On PostgreSQL the candidate row is locked with FOR UPDATE SKIP LOCKED so concurrent
    workers pick different jobs; SQLite ignores FOR UPDATE, so the caller runs this in a
    BEGIN IMMEDIATE transaction (``Database.write``), which serializes claims.
    """
    owner = fairshare.standings(
        now=fairshare.at_time(at),
        half_life=rule.half_life,
        window=rule.window_seconds if rule.has_budget else None,
    )
    candidate = (
        select(Job.id)
        .join(owner, owner.c.owner == Job.owner)
        .where(_claimable(), or_(Job.gpus.is_(None), Job.gpus <= gpus_held))
        .order_by(
            *fairshare.claim_order(
                Job.priority, owner.c.key, owner.c.running, Job.created_at, Job.id
            )
        )
        .limit(1)
    )
    if rule.max_running_per_user > 0:
        candidate = candidate.where(owner.c.running < rule.max_running_per_user)
    if rule.has_budget:
        candidate = candidate.where(
            or_(Job.status == "running", owner.c.spent < rule.budget_seconds)
        )
    if skip_locked:
        candidate = candidate.with_for_update(skip_locked=True, of=Job)
    row = session.execute(
        update(Job)
        .where(Job.id == candidate.scalar_subquery(), _claimable())
        .values(
            status="running",
            worker_id=worker_id,
            lease_expires_at=db_now(lease_seconds),
            attempt=Job.attempt + 1,
            started_at=func.coalesce(Job.started_at, db_now()),
            updated_at=db_now(),
            accrued_at=db_now(),
            # A request to stop that a vanished worker never acted on ends with its run.
            preempt_for=None,
            preempt_reason=None,
        )
        .returning(Job.id, Job.attempt, Job.spec, Job.checkpoint_step, Job.precision_decision)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if row is None:
        return None
    return Claim(
        job_id=row[0],
        attempt=row[1],
        spec=row[2],
        checkpoint_step=row[3],
        precision_decision=row[4],
    )


def renew_and_load(
    session: Session, *, job_id: int, worker_id: str, lease_seconds: float
) -> Job | None:
    """Extend our lease and load the job, by the fenced UPDATE (which returns the whole
    row); None if the job is no longer ours (another worker reclaimed it, or it was finished
    elsewhere). The history write that follows in the same transaction then needs no query
    to load the job; its ``updated_at`` is the database's time of the renewal."""
    job: Job | None = session.scalars(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status == "running")
        .values(lease_expires_at=db_now(lease_seconds), updated_at=db_now())
        .returning(Job)
        .execution_options(synchronize_session=False, populate_existing=True)
    ).one_or_none()
    return job


def finish(
    session: Session,
    *,
    job_id: int,
    worker_id: str,
    status: str,
    error: str | None = None,
    rule: fairshare.Rule = fairshare.Rule(),
) -> bool:
    """End a running job we hold, adding its run to its owner's usage. False if it is not
    ours any more."""
    assert status in FINISHED_STATUSES
    values: dict[str, Any] = {
        "status": status,
        "finished_at": db_now(),
        "updated_at": db_now(),
        "lease_expires_at": None,
    }
    if error is not None:
        values["error"] = error
    return _end_run(session, job_id=job_id, worker_id=worker_id, values=values, rule=rule)


def _end_run(
    session: Session, *, job_id: int, worker_id: str, values: dict[str, Any], rule: fairshare.Rule
) -> bool:
    """The fenced UPDATE that ends a run (finish or requeue), then the run's time added to
    its owner's usage in the same transaction. ``accrued_at`` is left as it was (only running
    jobs read it), so RETURNING gives the start of the unaccrued time on both databases."""
    row = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status == "running")
        .values(**values, preempt_for=None, preempt_reason=None)
        .returning(Job.owner, Job.accrued_at, Job.gpus)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if row is None:
        return False
    fairshare.accrue(session, owner=row[0], since=row[1], gpus=row[2], rule=rule)
    return True


def held_job(session: Session, *, job_id: int, worker_id: str) -> tuple[Job, datetime] | None:
    """The job row, locked, and the database's time, if ``worker_id`` still holds the job;
    None otherwise. What a worker writes into a job it holds is fenced by this."""
    row = session.execute(
        select(Job, db_now())
        .where(Job.id == job_id, Job.worker_id == worker_id, Job.status == "running")
        .with_for_update(of=Job)
    ).one_or_none()
    return None if row is None else (row[0], row[1])


def record_attempt_error(
    session: Session, *, job_id: int, worker_id: str, attempt: int, error: str
) -> bool:
    """Append an attempt's failure to the job, only while ``worker_id`` holds it: a worker
    whose lease was taken over must not write into the new owner's attempt. False if not."""
    held = held_job(session, job_id=job_id, worker_id=worker_id)
    if held is None:
        return False
    job, now = held
    job.attempt_errors = [
        *job.attempt_errors,
        {"attempt": attempt, "error": error, "at": now.isoformat()},
    ]
    session.flush()
    return True


def requeue(
    session: Session,
    *,
    job_id: int,
    worker_id: str,
    count_attempt: bool = True,
    rule: fairshare.Rule = fairshare.Rule(),
) -> bool:
    """Put a running job we hold back in the queue (a retry, or a worker shutting down),
    adding the run to its owner's usage. ``count_attempt=False`` gives the attempt back: the
    job did not fail."""
    values: dict[str, Any] = {
        "status": "queued",
        "worker_id": None,
        "lease_expires_at": None,
        "updated_at": db_now(),
    }
    if not count_attempt:
        values["attempt"] = Job.attempt - 1
    return _end_run(session, job_id=job_id, worker_id=worker_id, values=values, rule=rule)


def expire_abandoned(session: Session) -> int:
    """Finish running jobs whose worker vanished and that may not be retried: out of
    attempts (failed) or already asked to cancel (cancelled)."""
    stale = and_(Job.status == "running", Job.lease_expires_at < db_now())
    ended = {
        "finished_at": db_now(),
        "updated_at": db_now(),
        "lease_expires_at": None,
        "preempt_for": None,
        "preempt_reason": None,
    }
    cancelled = session.execute(
        update(Job)
        .where(stale, Job.cancel_requested.is_(True))
        .values(status="cancelled", **ended)
        .execution_options(synchronize_session=False)
    )
    failed = session.execute(
        update(Job)
        .where(stale, Job.attempt >= Job.max_attempts)
        .values(
            status="failed",
            error=func.coalesce(Job.error, "worker lost (lease expired) on the last attempt"),
            **ended,
        )
        .execution_options(synchronize_session=False)
    )
    return int(cancelled.rowcount + failed.rowcount)  # type: ignore[attr-defined]
