"""Preemption at checkpoints: which running job makes room for which waiting one, decided from
the database alone, so that supervisors on several hosts agree (docs/scheduling.md).

The rule. A running job R is asked to stop at its next checkpoint for a queued job W when

- preemption is on (``HALFWAY_PREEMPTION``) and R's spec says ``preemptible`` (the default);
- R's current run has lasted at least ``HALFWAY_PREEMPT_AFTER`` seconds (since its claim), R
  is not being cancelled, and no other waiting job has asked R already;
- W has waited at least ``HALFWAY_PREEMPT_WAIT`` seconds since it was queued (or requeued),
  so that a slot freeing elsewhere takes it first, and no running job is asked for W already;
- W would come before R in the claim order if R were queued, by a clear margin:
  ``priority``: W's priority is higher than R's; or ``share``: equal priorities, different
  owners, R's owner has some use, and W's owner's standing (usage / weight, the claim's key,
  ``service.scheduling.fairshare``) is at most half of R's owner's (``FAR_BELOW``). The margin
  keeps two owners of nearly equal standing from taking the slot from each other back and forth;
- W fits where R runs: W needs no more GPUs than R holds, and W's owner is under the
  per-user cap (``HALFWAY_MAX_RUNNING_PER_USER``) and within their budget
  (``HALFWAY_BUDGET_SLOT_HOURS``), as the claim requires.

The waiting jobs are taken in claim order; the first that has an eligible R gets one, the
victim being the lowest priority, then the owner furthest over their share (highest
standing), then the longest running, then the lowest id. The request is one conditional
UPDATE of R (``preempt_for`` = W). A unique index on ``preempt_for`` makes sure that of two
supervisors deciding at once for the same W only one marks a job; the UPDATE's own guard,
``preempt_for IS NULL``, that a job is never asked twice.

R's supervisor sees the mark in its periodic check (``pending``), stops its child as a
shutdown does (SIGTERM: stop at the next execution boundary, write the checkpoint), records
the preemption (``record``) and puts the job back in the queue without spending an attempt.
A mark for a W that is no longer waiting (claimed elsewhere, cancelled) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import and_, exists, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from service.database.dbclock import db_now
from service.database.models import Job
from service.scheduling import fairshare
from service.scheduling.jobs import held_job
from service.settings import Settings

# W's owner must stand at most this fraction of R's owner's standing to preempt for share.
FAR_BELOW = 0.5
# How many waiting jobs, in claim order, are looked at for a victim.
WAITING_SCAN = 50

Reason = Literal["priority", "share"]


@dataclass(frozen=True)
class Rule:
    enabled: bool = True
    after: float = 1800.0  # seconds R's run must have lasted
    wait: float = 30.0  # seconds W must have waited
    fair: fairshare.Rule = field(default_factory=fairshare.Rule)  # W must be claimable by it

    @classmethod
    def from_settings(cls, settings: Settings) -> Rule:
        return cls(
            enabled=settings.preemption == "on",
            after=settings.preempt_after,
            wait=settings.preempt_wait,
            fair=fairshare.Rule.from_settings(settings),
        )


@dataclass(frozen=True)
class Request:
    job_id: int  # the running job asked to stop
    by_job: int  # the waiting job it makes room for
    reason: Reason


def why(waiting: Any, running: Any) -> Reason | None:
    """Why ``waiting`` may take ``running``'s slot, or None. Rows with ``owner``,
    ``priority`` and ``key`` (the owner's standing)."""
    if waiting.priority > running.priority:
        return "priority"
    if (
        waiting.priority == running.priority
        and waiting.owner != running.owner
        and running.key > 0
        and waiting.key <= FAR_BELOW * running.key
    ):
        return "share"
    return None


def choose(session: Session, rule: Rule, *, at: datetime | None = None) -> Request | None:
    """The one request the rule makes now, or None."""
    if not rule.enabled:
        return None
    now = fairshare.at_time(at)
    fair = rule.fair
    st = fairshare.standings(
        now=now, half_life=fair.half_life, window=fair.window_seconds if fair.has_budget else None
    )
    ran = fairshare.seconds_between(Job.accrued_at, now)
    running = session.execute(
        select(Job.id, Job.owner, Job.priority, Job.gpus, Job.spec, st.c.key, ran.label("ran"))
        .join(st, st.c.owner == Job.owner)
        .where(
            Job.status == "running",
            Job.lease_expires_at >= db_now(),
            Job.accrued_at.is_not(None),
            Job.preempt_for.is_(None),
            Job.cancel_requested.is_(False),
            ran >= rule.after,
        )
    ).all()
    victims = [r for r in running if r.spec.get("preemptible", True) is not False]
    if not victims:
        return None
    victims.sort(key=lambda r: (r.priority, -r.key, -r.ran, r.id))
    asked = aliased(Job)
    waiting = (
        select(Job.id, Job.owner, Job.priority, Job.gpus, st.c.key, st.c.running)
        .join(st, st.c.owner == Job.owner)
        .where(
            Job.status == "queued",
            fairshare.seconds_between(Job.updated_at, now) >= rule.wait,
            ~exists().where(asked.preempt_for == Job.id),
        )
        .order_by(
            *fairshare.claim_order(Job.priority, st.c.key, st.c.running, Job.created_at, Job.id)
        )
        .limit(WAITING_SCAN)
    )
    if fair.max_running_per_user > 0:
        waiting = waiting.where(st.c.running < fair.max_running_per_user)
    if fair.has_budget:  # an owner out of budget waits for the next window, not for a slot
        waiting = waiting.where(st.c.spent < fair.budget_seconds)
    for w in session.execute(waiting):
        for r in victims:
            reason = why(w, r)
            if reason is not None and (w.gpus or 0) <= (r.gpus or 0):
                return Request(job_id=r.id, by_job=w.id, reason=reason)
    return None


def mark(session: Session, request: Request, rule: Rule) -> bool:
    """Ask ``request.job_id`` to stop for ``request.by_job``: one conditional UPDATE (the job
    still runs, long enough, is asked by nobody else; the waiting job still waits and nobody
    is asked for it yet). False if it did not happen."""
    waiting = aliased(Job)
    asked = aliased(Job)
    try:
        with session.begin_nested():
            done = session.execute(
                update(Job)
                .where(
                    Job.id == request.job_id,
                    Job.status == "running",
                    Job.preempt_for.is_(None),
                    Job.cancel_requested.is_(False),
                    fairshare.seconds_between(Job.accrued_at, db_now()) >= rule.after,
                    exists().where(and_(waiting.id == request.by_job, waiting.status == "queued")),
                    ~exists().where(asked.preempt_for == request.by_job),
                )
                .values(preempt_for=request.by_job, preempt_reason=request.reason)
                .execution_options(synchronize_session=False)
            )
    except IntegrityError:  # another supervisor asked a job for the same W just now
        return False
    return bool(done.rowcount)  # type: ignore[attr-defined]


def request(session: Session, rule: Rule, *, at: datetime | None = None) -> Request | None:
    """Decide and mark: the request made, or None."""
    chosen = choose(session, rule, at=at)
    if chosen is None or not mark(session, chosen, rule):
        return None
    return chosen


def pending(session: Session, *, job_id: int, worker_id: str) -> Request | None:
    """The request to stop that ``worker_id``'s run of ``job_id`` must follow, if any. A
    request for a job that no longer waits (another slot took it, it was cancelled) is
    dropped instead."""
    row = session.execute(
        select(Job.preempt_for, Job.preempt_reason).where(
            Job.id == job_id, Job.worker_id == worker_id, Job.status == "running"
        )
    ).one_or_none()
    if row is None or row[0] is None:
        return None
    by_job = int(row[0])
    if session.scalar(select(Job.status).where(Job.id == by_job)) == "queued":
        reason: Reason = "priority" if row[1] == "priority" else "share"
        return Request(job_id=job_id, by_job=by_job, reason=reason)
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.preempt_for == by_job)
        .values(preempt_for=None, preempt_reason=None)
        .execution_options(synchronize_session=False)
    )
    return None


def check(session: Session, rule: Rule, *, job_id: int, worker_id: str) -> Request | None:
    """A running job's supervisor's periodic look: make the request the rule makes now (for
    whichever running job it names), then say whether our own run must stop."""
    if not rule.enabled:
        return None
    request(session, rule)
    return pending(session, job_id=job_id, worker_id=worker_id)


def record(session: Session, *, job_id: int, worker_id: str, request: Request) -> bool:
    """Append the preemption to the job we hold, with the checkpoint it resumes from (the
    acknowledged one), and a note. False if the job is not ours any more."""
    held = held_job(session, job_id=job_id, worker_id=worker_id)
    if held is None:
        return False
    job, now = held
    step = job.checkpoint_step
    job.preemptions = [
        *job.preemptions,
        {"at": now.isoformat(), "by_job": request.by_job, "reason": request.reason, "step": step},
    ]
    where = "from the start" if step is None else f"from step {step}"
    job.notes = [
        *job.notes,
        f"preempted for job {request.by_job} ({request.reason}); resumes {where}",
    ]
    session.flush()
    return True
