"""History: writing step records (idempotent upserts) and reading them back, every query a
bounded range of the ``(job_id, step)`` primary key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

import psycopg
from sqlalchemy import (
    ColumnElement,
    delete,
    func,
    or_,
    select,
    text,
)
from sqlalchemy.orm import Session

from service.database.db import upsert
from service.database.models import FLOAT32_MAX, Job, ScaleEvent, Step, StepRollup
from service.recording import epochmetrics, gradients, ingest
from service.recording.records import StepRecord
from service.recording.rollups import (
    LEVEL_BLOCKS,
    refresh_rollups,
)


def _insert_steps_pg(session: Session, job_id: int, records: Sequence[StepRecord]) -> None:
    """Binary COPY: the fastest way into PostgreSQL (800k rows/s here into the step table,
    which has no foreign key for this reason, against 88k for one INSERT of arrays). A batch
    that meets a stored row (resent after a lost acknowledgement) stores only its new rows.

    Not DO UPDATE (which doubles PostgreSQL's cost per row): a step is only ever written
    again with the same values. A resumed attempt re-runs steps only after truncate_after
    deleted them, a worker that lost its lease writes nothing (the write is fenced), so a
    conflict can only be a batch resent after a commit whose acknowledgement was lost, and
    that batch is the one already stored."""
    raw = session.connection().connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    values = ingest.step_values(records)
    if not ingest.copy_steps(raw, job_id, values):
        ingest.insert_new_steps(raw, job_id, values)


def scale_events(
    records: Sequence[StepRecord], previous_scale: float | None
) -> list[dict[str, Any]]:
    """Each change of the scale between consecutive steps (``ingest.scale_changes``, the one
    rule), as rows. ``previous_scale`` is the scale of the step before ``records[0]``."""
    if not records:
        return []
    values = ingest.step_values(records)
    changed, old, new = ingest.scale_changes(values, previous_scale)
    return [
        {
            "step": int(values[i, 0]),
            "old_scale": float(o),
            "new_scale": float(n),
            "reason": "overflow" if n < o else "growth",
        }
        for i, o, n in zip(changed.tolist(), old.tolist(), new.tolist(), strict=True)
    ]


def write_steps(
    session: Session,
    job: Job,
    records: Sequence[StepRecord],
    *,
    now: datetime,
    steps_per_second: float | None = None,
    durable: bool = True,
) -> None:
    """Upsert a batch of step records (in step order) and fold them into the job's summary.

    A batch may be written twice (a commit whose acknowledgement was lost, a retry): the rows
    are upserts and the counters only count steps past the summary's ``last_step``, so a
    rewrite changes nothing. ``durable=False``: the transaction's commit need not wait for
    the disk (``relax_commit``); the caller must be able to write the batch again.
    """
    if not records:
        return
    touched: dict[str, Any] = {"updated_at": now}
    if steps_per_second is not None:
        touched["steps_per_second"] = steps_per_second
    if ingest.appends(session, job, records):
        first = records[0].step
        events = scale_events(records, ingest.previous_scale(job.last_step, job.loss_scale, first))
        summary = _summary_after(job, records, events) | touched
        if ingest.append_pg(session, job, records, summary, durable=durable):
            return
    if not durable:
        relax_commit(session)
    events = _rewrite_steps(session, job.id, records)
    for name, value in (_summary_after(job, records, events) | touched).items():
        setattr(job, name, value)
    session.flush()


def _rewrite_steps(
    session: Session, job_id: int, records: Sequence[StepRecord]
) -> list[dict[str, Any]]:
    """The general write: upserts whatever is stored already, and recomputes the rollups of
    the range from the stored rows. Returns the batch's scale events."""
    first = records[0].step
    previous = session.scalar(
        select(Step.loss_scale).where(Step.job_id == job_id, Step.step == first - 1)
    )
    if session.get_bind().dialect.name == "postgresql":
        _insert_steps_pg(session, job_id, records)
    else:
        upsert(
            session,
            Step.__table__,  # type: ignore[arg-type]
            [{"job_id": job_id, **r._asdict()} for r in records],
            ["job_id", "step"],
        )
    refresh_rollups(session, job_id, first, records[-1].step)
    events = scale_events(records, previous)
    upsert(
        session,
        ScaleEvent.__table__,  # type: ignore[arg-type]
        [{"job_id": job_id, **e} for e in events],
        ["job_id", "step"],
    )
    return events


def _summary_after(
    job: Job, records: Sequence[StepRecord], events: list[dict[str, Any]]
) -> dict[str, Any]:
    """The summary's new values once ``records`` are written. Counters count only steps past
    the summary's ``last_step``: a rewrite changes none."""
    seen = job.last_step if job.last_step is not None else -1
    fresh = [r for r in records if r.step > seen]
    if not fresh:
        return {}
    fresh_events = [e for e in events if e["step"] > seen]
    last = fresh[-1]
    batch_min = min(r.loss_scale for r in fresh)
    overflows = sum(1 for r in fresh if not r.finite)
    backoffs = sum(1 for e in fresh_events if e["reason"] == "overflow")
    return {
        "last_step": last.step,
        "epoch": last.epoch,
        "last_loss": last.loss,
        "loss_scale": last.loss_scale,
        "min_loss_scale": (
            batch_min if job.min_loss_scale is None else min(job.min_loss_scale, batch_min)
        ),
        "overflow_count": job.overflow_count + overflows,
        "nonfinite_loss_count": (
            job.nonfinite_loss_count + sum(1 for r in fresh if not math.isfinite(r.loss))
        ),
        "growth_count": job.growth_count + sum(1 for e in fresh_events if e["reason"] == "growth"),
        "backoff_count": job.backoff_count + backoffs,
        # What /metrics counts only grows: a truncation recomputes the summary, never these.
        "steps_recorded": job.steps_recorded + len(fresh),
        "overflows_recorded": job.overflows_recorded + overflows,
        "backoffs_recorded": job.backoffs_recorded + backoffs,
    }


def relax_commit(session: Session) -> None:
    """Let this transaction's commit return before its WAL reaches the disk (PostgreSQL;
    SQLite in WAL mode with synchronous=NORMAL already does). A crash of the database may
    then lose it, never corrupt anything: the caller must be able to write it again."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL synchronous_commit TO OFF"))


def truncate_after(session: Session, job: Job, step: int) -> None:
    """Forget history from ``step`` on (a resumed attempt re-runs those steps), its gradient
    samples and the metrics of the epoch holding ``step`` and of later ones with it, and
    recompute the summaries from what remains, so they match the rows exactly. When steps or
    samples were forgotten, the job's ``history_version`` moves on, so that clients drop what
    they read from there. The caller writes the attempt's new rows
    after this, in the same transaction."""
    forgotten = session.execute(delete(Step).where(Step.job_id == job.id, Step.step >= step))
    samples_forgotten = gradients.truncate_samples(session, job, step)
    # No version of their own: an epoch's metrics are written after its last step, so any
    # forgotten here went with steps forgotten above.
    epochmetrics.truncate_epochs(session, job, step)
    if forgotten.rowcount or samples_forgotten:  # type: ignore[attr-defined]
        job.history_version += 1
        job.history_reset_step = step
    session.execute(delete(ScaleEvent).where(ScaleEvent.job_id == job.id, ScaleEvent.step >= step))
    # At each level, every block from the one holding step - 1 on goes: those past the cut
    # are empty now, and a block that starts exactly at the cut (the common case: checkpoints
    # fall on multiples of 64) must not go on counting deleted steps. The block holding
    # step - 1 is then rebuilt from the rows that remain.
    session.execute(
        delete(StepRollup).where(
            StepRollup.job_id == job.id,
            or_(
                *(
                    (StepRollup.level == level) & (StepRollup.block >= (step - 1) // size)
                    for level, size in enumerate(LEVEL_BLOCKS)
                )
            ),
        )
    )
    if step > 0:
        refresh_rollups(session, job.id, step - 1, step - 1)
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


def loss_is_nonfinite() -> ColumnElement[bool]:
    """NaN is stored as NULL (see ``NanAsNullReal``); +/-inf are stored as themselves."""
    return or_(Step.loss.is_(None), Step.loss > FLOAT32_MAX, Step.loss < -FLOAT32_MAX)


class StepRow(Protocol):
    step: int
    epoch: int
    loss: float
    loss_scale: float
    finite: bool


def read_steps(
    session: Session, job_id: int, *, after_step: int, limit: int, up_to: int | None = None
) -> tuple[list[StepRow], bool]:
    """Rows with after_step < step (<= up_to) in step order; the bool says whether more
    follow. Plain rows, not ORM objects: building a thousand of those per poll cost more than
    the query."""
    query = select(Step.step, Step.epoch, Step.loss, Step.loss_scale, Step.finite).where(
        Step.job_id == job_id, Step.step > after_step
    )
    if up_to is not None:
        query = query.where(Step.step <= up_to)
    rows: list[StepRow] = list(session.execute(query.order_by(Step.step).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


# --------------------------------------------------------------------------------------------
# Rollups and buckets: the history cut into P ranges, each summarized so that no spike and no
# overflow is averaged away.


def step_range(session: Session, job_id: int) -> tuple[int, int] | None:
    """First and last recorded step (two index probes, not a scan)."""
    first = session.scalar(
        select(Step.step).where(Step.job_id == job_id).order_by(Step.step).limit(1)
    )
    if first is None:
        return None
    last = session.scalar(
        select(Step.step).where(Step.job_id == job_id).order_by(Step.step.desc()).limit(1)
    )
    assert last is not None
    return first, last
