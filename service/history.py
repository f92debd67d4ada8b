"""History: writing step records (idempotent upserts) and reading them back, every query a
bounded range of the ``(job_id, step)`` primary key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Table, delete, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.models import Job, ScaleEvent, Step


class StepRecord(NamedTuple):
    step: int
    epoch: int
    loss: float
    loss_scale: float
    finite: bool


def _upsert(session: Session, table: Table, rows: list[dict[str, Any]], keys: list[str]) -> None:
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(table)
    stmt = stmt.on_conflict_do_update(
        index_elements=keys,
        set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys},
    )
    session.execute(stmt, rows)


def scale_events(
    records: Sequence[StepRecord], previous_scale: float | None
) -> list[dict[str, Any]]:
    """Each change of the scale between consecutive steps: a fall follows an overflow, a rise
    is growth. ``previous_scale`` is the scale of the step before ``records[0]``."""
    events = []
    prev = previous_scale
    for r in records:
        if prev is not None and r.loss_scale != prev:
            events.append(
                {
                    "step": r.step,
                    "old_scale": prev,
                    "new_scale": r.loss_scale,
                    "reason": "overflow" if r.loss_scale < prev else "growth",
                }
            )
        prev = r.loss_scale
    return events


def write_steps(
    session: Session,
    job: Job,
    records: Sequence[StepRecord],
    *,
    now: datetime,
    steps_per_second: float | None = None,
) -> None:
    """Upsert a batch of step records (in step order) and fold them into the job's summary.

    A batch may be written twice (a commit whose acknowledgement was lost, a retry): the rows
    are upserts and the counters only count steps past the summary's ``last_step``, so a
    rewrite changes nothing.
    """
    if not records:
        return
    job_id = job.id
    first = records[0].step
    previous = session.scalar(
        select(Step.loss_scale).where(Step.job_id == job_id, Step.step == first - 1)
    )
    _upsert(
        session,
        Step.__table__,  # type: ignore[arg-type]
        [{"job_id": job_id, **r._asdict()} for r in records],
        ["job_id", "step"],
    )
    events = scale_events(records, previous)
    _upsert(
        session,
        ScaleEvent.__table__,  # type: ignore[arg-type]
        [{"job_id": job_id, **e} for e in events],
        ["job_id", "step"],
    )

    seen = job.last_step if job.last_step is not None else -1
    fresh = [r for r in records if r.step > seen]
    fresh_events = [e for e in events if e["step"] > seen]
    if fresh:
        last = fresh[-1]
        job.last_step = last.step
        job.epoch = last.epoch
        job.last_loss = last.loss
        job.loss_scale = last.loss_scale
        batch_min = min(r.loss_scale for r in fresh)
        job.min_loss_scale = (
            batch_min if job.min_loss_scale is None else min(job.min_loss_scale, batch_min)
        )
        job.overflow_count += sum(1 for r in fresh if not r.finite)
        job.nonfinite_loss_count += sum(1 for r in fresh if not math.isfinite(r.loss))
        job.growth_count += sum(1 for e in fresh_events if e["reason"] == "growth")
        job.backoff_count += sum(1 for e in fresh_events if e["reason"] == "overflow")
    if steps_per_second is not None:
        job.steps_per_second = steps_per_second
    job.updated_at = now
    session.flush()


def truncate_after(session: Session, job: Job, step: int) -> None:
    """Forget history from ``step`` on (a resumed attempt re-runs those steps) and recompute
    the summary from what remains, so it matches the rows exactly."""
    session.execute(delete(Step).where(Step.job_id == job.id, Step.step >= step))
    session.execute(delete(ScaleEvent).where(ScaleEvent.job_id == job.id, ScaleEvent.step >= step))
    agg = session.execute(
        select(
            func.max(Step.step),
            func.count().filter(Step.finite.is_(False)),
            func.min(Step.loss_scale),
        ).where(Step.job_id == job.id)
    ).one()
    last_step, overflows, min_scale = agg
    events = session.execute(
        select(ScaleEvent.reason, func.count())
        .where(ScaleEvent.job_id == job.id)
        .group_by(ScaleEvent.reason)
    ).all()
    counts = dict((reason, n) for reason, n in events)
    job.last_step = last_step
    job.overflow_count = int(overflows or 0)
    job.min_loss_scale = min_scale
    job.growth_count = int(counts.get("growth", 0))
    job.backoff_count = int(counts.get("overflow", 0))
    if last_step is not None:
        last = session.get(Step, (job.id, last_step))
        assert last is not None
        job.last_loss, job.loss_scale, job.epoch = last.loss, last.loss_scale, last.epoch
        job.nonfinite_loss_count = int(
            session.scalar(select(func.count()).where(Step.job_id == job.id, loss_is_nonfinite()))
            or 0
        )
    else:
        job.last_loss = job.loss_scale = job.epoch = None
        job.nonfinite_loss_count = 0
    session.flush()


FLOAT32_MAX = 3.4028234663852886e38


def loss_is_nonfinite() -> ColumnElement[bool]:
    """NaN is stored as NULL (see ``NanAsNullReal``); +/-inf are stored as themselves."""
    return or_(Step.loss.is_(None), Step.loss > FLOAT32_MAX, Step.loss < -FLOAT32_MAX)


def read_steps(
    session: Session, job_id: int, *, after_step: int, limit: int
) -> tuple[list[Step], bool]:
    """Rows with step > after_step in step order; the bool says whether more follow."""
    rows = list(
        session.scalars(
            select(Step)
            .where(Step.job_id == job_id, Step.step > after_step)
            .order_by(Step.step)
            .limit(limit + 1)
        )
    )
    return rows[:limit], len(rows) > limit
