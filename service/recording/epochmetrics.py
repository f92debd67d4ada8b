"""Per-epoch metrics: what Keras reported at the end of each epoch (loss, accuracy, the
validation twins and the rest), one ``epoch_metric`` row per job and epoch. Written by the
supervisor's general flush (fenced, in the same transaction as the steps), idempotent on
``(job_id, epoch)``, cut with the history on a resume (``history.truncate_after``). A handful
of rows per job: every read is the whole job's, by its primary key. No TensorFlow."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.database.db import upsert
from service.database.models import EpochMetric, Job

# The child runs the user's code (their callbacks can put anything in Keras' logs): what it
# sends is kept within these bounds rather than trusted.
MAX_METRICS = 200
MAX_NAME = 200
MAX_EPOCH = 2**31 - 1


def clean_epoch(epoch: int, metrics: Any) -> dict[str, Any]:
    """One epoch's metrics as the child sent them, made safe to store: at most
    ``MAX_METRICS`` names, as text cut to ``MAX_NAME``, each value a finite float or None
    (NaN and infinity are null: JSON has neither; neither has a value that is no number)."""
    out: dict[str, float | None] = {}
    items = list(metrics.items())[:MAX_METRICS] if isinstance(metrics, Mapping) else []
    for name, value in items:
        out[str(name)[:MAX_NAME]] = _finite(value)
    return {"epoch": min(max(int(epoch), 0), MAX_EPOCH), "metrics": out}


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def write_epochs(session: Session, job: Job, epochs: list[dict[str, Any]]) -> None:
    """Store epochs (cleaned by ``clean_epoch``), replacing one stored already: only a resent
    batch meets one (the same values), since a resumed attempt's epochs from its cut on were
    deleted by the truncation that precedes them in the same transaction."""
    by_epoch = {e["epoch"]: e["metrics"] for e in epochs}  # the last sent winning
    upsert(
        session,
        EpochMetric.__table__,  # type: ignore[arg-type]
        [{"job_id": job.id, "epoch": k, "metrics": v} for k, v in by_epoch.items()],
        ["job_id", "epoch"],
    )


def truncate_epochs(session: Session, job: Job, step: int) -> int:
    """Forget the epochs from the one holding ``step`` on: a resumed attempt restarts in it
    and reports it (and every later one) again. How many were forgotten.

    ``job.steps_per_epoch`` is the interrupted attempt's (the resumed one's is written after
    the cut, in the same flush, and is the same: the spec fixes it). A job without it has
    never started an attempt, so has no epoch either: everything goes, which is nothing."""
    per_epoch = job.steps_per_epoch
    first = step // per_epoch if per_epoch else 0
    forgotten = session.execute(
        delete(EpochMetric).where(EpochMetric.job_id == job.id, EpochMetric.epoch >= first)
    )
    return int(forgotten.rowcount)  # type: ignore[attr-defined]


def read_epochs(session: Session, job_id: int) -> list[dict[str, Any]]:
    """Every stored epoch of the job, in epoch order: ``{"epoch", "metrics"}``."""
    rows = session.execute(
        select(EpochMetric.epoch, EpochMetric.metrics)
        .where(EpochMetric.job_id == job_id)
        .order_by(EpochMetric.epoch)
    ).all()
    return [{"epoch": epoch, "metrics": metrics} for epoch, metrics in rows]
