"""The common history write on PostgreSQL: a batch that only appends (every step past the
job's last recorded one), which is what a running job sends every flush.

Such a batch cannot meet a stored row: the job's ``last_step`` is the greatest stored step
(only ``write_steps`` and ``truncate_after`` change either, each keeping them equal), and the
lease renewal that precedes the write holds the job's row locked, so no other writer of this
job can slip in. That lets the write skip what a general upsert needs:

- the scale of the step before the batch is the summary's ``loss_scale`` (no query);
- the rows go in by binary COPY without a savepoint (there is no conflict to recover from);
- the rollups need not be recomputed from the stored rows: the batch's rows are all new, so
  each block's summary is the stored one merged with the batch's, at all three levels, in one
  statement that also inserts the batch's scale events.

Everything else (a resent batch, a partly written one, SQLite) takes the general path in
``history.write_steps``, which recomputes from the rows and is idempotent.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy import REAL, Integer, String, bindparam, text
from sqlalchemy.dialects import postgresql

from service.models import Job, float32

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from service.history import StepRecord

# Steps per rollup block, by level (``history.LEVEL_BLOCKS``; restated to keep this module
# free of an import cycle, and checked equal by the tests).
LEVEL_BLOCKS = (64, 4096, 262144)
FLOAT32_MAX = 3.4028234663852886e38

_COPY_STEPS = "COPY step (job_id, step, epoch, loss, loss_scale, finite) FROM STDIN (FORMAT BINARY)"

_MERGE_COLUMNS = (
    "level",
    "block",
    "first_step",
    "last_step",
    "count",
    "loss_min",
    "loss_max",
    "loss_last",
    "scale_min",
    "scale_max",
    "scale_last",
    "overflow_count",
    "nonfinite_loss_count",
)
_INT_COLUMNS = {"level", "block", "first_step", "last_step", "count", "overflow_count"}
_INT_COLUMNS |= {"nonfinite_loss_count"}

# In DO UPDATE, ``r`` is the stored row before this statement; LEAST and GREATEST skip NULLs
# (a block with no finite loss yet). NULL in loss_last is a NaN loss (NanAsNullReal).
_MERGE_PG = text(
    f"""
    WITH events AS (
        INSERT INTO scale_event (job_id, step, old_scale, new_scale, reason)
        SELECT :job_id, e.step, e.old_scale, e.new_scale, e.reason
        FROM unnest(:ev_step, :ev_old, :ev_new, :ev_reason) AS e(step, old_scale, new_scale, reason)
        ON CONFLICT (job_id, step) DO UPDATE SET old_scale = excluded.old_scale,
            new_scale = excluded.new_scale, reason = excluded.reason
    )
    INSERT INTO step_rollup AS r (job_id, {", ".join(_MERGE_COLUMNS)})
    SELECT :job_id, b.*
    FROM unnest({", ".join(f":{c}" for c in _MERGE_COLUMNS)}) AS b({", ".join(_MERGE_COLUMNS)})
    ON CONFLICT (job_id, level, block) DO UPDATE SET
        first_step = LEAST(r.first_step, excluded.first_step),
        last_step = GREATEST(r.last_step, excluded.last_step),
        count = r.count + excluded.count,
        loss_min = LEAST(r.loss_min, excluded.loss_min),
        loss_max = GREATEST(r.loss_max, excluded.loss_max),
        loss_last = CASE WHEN excluded.last_step > r.last_step
                         THEN excluded.loss_last ELSE r.loss_last END,
        scale_min = LEAST(r.scale_min, excluded.scale_min),
        scale_max = GREATEST(r.scale_max, excluded.scale_max),
        scale_last = CASE WHEN excluded.last_step > r.last_step
                          THEN excluded.scale_last ELSE r.scale_last END,
        overflow_count = r.overflow_count + excluded.overflow_count,
        nonfinite_loss_count = r.nonfinite_loss_count + excluded.nonfinite_loss_count
    """
).bindparams(
    bindparam("ev_step", type_=postgresql.ARRAY(Integer)),
    bindparam("ev_old", type_=postgresql.ARRAY(REAL)),
    bindparam("ev_new", type_=postgresql.ARRAY(REAL)),
    bindparam("ev_reason", type_=postgresql.ARRAY(String)),
    *(
        bindparam(c, type_=postgresql.ARRAY(Integer if c in _INT_COLUMNS else REAL))
        for c in _MERGE_COLUMNS
    ),
)


def appends(session: Session, job: Job, records: Sequence[StepRecord]) -> bool:
    """Whether this batch may take the append path (see the module's doc)."""
    if session.get_bind().dialect.name != "postgresql":
        return False
    if job.last_step is not None and records[0].step <= job.last_step:
        return False
    steps = [r.step for r in records]
    return all(a < b for a, b in itertools.pairwise(steps))


def _nan_as_null(value: float) -> float | None:
    return None if math.isnan(value) else value


def _block_summaries(records: Sequence[StepRecord]) -> dict[str, list[Any]]:
    """The batch's summary of each block it touches, at every level, as one array per
    column (``_MERGE_COLUMNS``). Level 0 from the rows, in one flat pass; each higher level
    from the level-0 summaries (a batch of 333 rows touches a handful of blocks)."""
    size = LEVEL_BLOCKS[0]
    # Per level-0 block: block, first, last, count, loss min, loss max, loss last,
    # scale min, scale max, scale last, overflows, non-finite losses.
    blocks: list[list[Any]] = []
    cur: list[Any] = [None]
    for r in records:
        block = r.step // size
        if cur[0] != block:
            scale = r.loss_scale
            cur = [block, r.step, r.step, 0, None, None, r.loss, scale, scale, scale, 0, 0]
            blocks.append(cur)
        cur[2] = r.step
        cur[3] += 1
        loss = r.loss
        cur[6] = loss
        if -FLOAT32_MAX <= loss <= FLOAT32_MAX:  # False for NaN and +/-inf
            if cur[4] is None or loss < cur[4]:
                cur[4] = loss
            if cur[5] is None or loss > cur[5]:
                cur[5] = loss
        else:
            cur[11] += 1
        scale = r.loss_scale
        if scale < cur[7]:
            cur[7] = scale
        if scale > cur[8]:
            cur[8] = scale
        cur[9] = scale
        if not r.finite:
            cur[10] += 1
    rows = [(0, *b) for b in blocks]
    for level in range(1, len(LEVEL_BLOCKS)):
        per = LEVEL_BLOCKS[level] // size
        merged: dict[int, list[Any]] = {}
        for b in blocks:  # in step order, so a later block's "last" wins
            key = b[0] // per
            m = merged.get(key)
            if m is None:
                merged[key] = [key, *b[1:]]
                continue
            m[2] = b[2]
            m[3] += b[3]
            m[4] = b[4] if m[4] is None else m[4] if b[4] is None else min(m[4], b[4])
            m[5] = b[5] if m[5] is None else m[5] if b[5] is None else max(m[5], b[5])
            m[6] = b[6]
            m[7] = min(m[7], b[7])
            m[8] = max(m[8], b[8])
            m[9] = b[9]
            m[10] += b[10]
            m[11] += b[11]
        rows += [(level, *m) for m in merged.values()]
    transposed = zip(*rows, strict=True)
    columns = {name: list(values) for name, values in zip(_MERGE_COLUMNS, transposed, strict=True)}
    columns["loss_last"] = [_nan_as_null(v) for v in columns["loss_last"]]
    return columns


def append_pg(session: Session, job: Job, records: Sequence[StepRecord]) -> list[dict[str, Any]]:
    """Write an appending batch (``appends`` said yes); the scale events it holds."""
    from service.history import scale_events

    job_id = job.id
    first = records[0].step
    previous = (
        float32(job.loss_scale)
        if job.last_step is not None and job.last_step == first - 1 and job.loss_scale is not None
        else None
    )
    raw = session.connection().connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    with raw.cursor() as cursor, cursor.copy(_COPY_STEPS) as copy:
        copy.set_types(["int4", "int4", "int4", "float4", "float4", "bool"])
        for r in records:
            copy.write_row((job_id, r.step, r.epoch, _nan_as_null(r.loss), r.loss_scale, r.finite))
    events = scale_events(records, previous)
    params: dict[str, Any] = {
        "job_id": job_id,
        "ev_step": [e["step"] for e in events],
        "ev_old": [e["old_scale"] for e in events],
        "ev_new": [e["new_scale"] for e in events],
        "ev_reason": [e["reason"] for e in events],
    }
    params.update(_block_summaries(records))
    session.execute(_MERGE_PG, params)
    return events
