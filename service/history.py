"""History: writing step records (idempotent upserts) and reading them back, every query a
bounded range of the ``(job_id, step)`` primary key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, Protocol

import psycopg
from sqlalchemy import (
    REAL,
    Boolean,
    ColumnElement,
    Integer,
    Table,
    any_,
    bindparam,
    delete,
    func,
    or_,
    select,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service import ingest
from service.models import Job, ScaleEvent, Step, StepRollup, float32


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


# PostgreSQL: a batch in one statement, its columns as five array parameters. executemany,
# even pipelined, spends most of its time per row in the driver (18k rows/s here); this is one
# round trip and one plan for the whole batch.
#
# DO NOTHING rather than DO UPDATE (which doubles PostgreSQL's cost per row): a step is only
# ever written again with the same values. A resumed attempt re-runs steps only after
# truncate_after deleted them, a worker that lost its lease writes nothing (the write is
# fenced), so a conflict can only be a batch resent after a commit whose acknowledgement was
# lost, and that batch is the one already stored.
_INSERT_STEPS_PG = text(
    """
    INSERT INTO step (job_id, step, epoch, loss, loss_scale, finite)
    SELECT :job_id, t.step, t.epoch, t.loss, t.loss_scale, t.finite
    FROM unnest(:steps, :epochs, :losses, :scales, :finite)
         AS t(step, epoch, loss, loss_scale, finite)
    ON CONFLICT (job_id, step) DO NOTHING
    """
).bindparams(
    bindparam("steps", type_=postgresql.ARRAY(Integer)),
    bindparam("epochs", type_=postgresql.ARRAY(Integer)),
    bindparam("losses", type_=postgresql.ARRAY(REAL)),
    bindparam("scales", type_=postgresql.ARRAY(REAL)),
    bindparam("finite", type_=postgresql.ARRAY(Boolean)),
)


_COPY_STEPS = "COPY step (job_id, step, epoch, loss, loss_scale, finite) FROM STDIN (FORMAT BINARY)"


def _insert_steps_pg(session: Session, job_id: int, records: Sequence[StepRecord]) -> None:
    """Binary COPY: the fastest way into PostgreSQL (800k rows/s here into the step table,
    which has no foreign key for this reason, against 88k for the statement below). COPY
    cannot skip conflicts, so it runs in a savepoint, and a batch that meets one (resent after
    a lost acknowledgement) takes the INSERT ... DO NOTHING path."""
    raw = session.connection().connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    try:
        with raw.transaction(), raw.cursor() as cursor, cursor.copy(_COPY_STEPS) as copy:
            copy.set_types(["int4", "int4", "int4", "float4", "float4", "bool"])
            for r in records:
                loss = None if math.isnan(r.loss) else r.loss  # NaN is stored as NULL
                copy.write_row((job_id, r.step, r.epoch, loss, r.loss_scale, r.finite))
        return
    except psycopg.errors.UniqueViolation:
        pass  # the savepoint is rolled back; nothing of this batch was stored
    session.execute(
        _INSERT_STEPS_PG,
        {
            "job_id": job_id,
            "steps": [r.step for r in records],
            "epochs": [r.epoch for r in records],
            # NaN is stored as NULL (NanAsNullReal), on this path too.
            "losses": [None if math.isnan(r.loss) else r.loss for r in records],
            "scales": [r.loss_scale for r in records],
            "finite": [r.finite for r in records],
        },
    )


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
        events = scale_events(records, ingest.previous_scale(job, records[0].step))
        summary = _summary_after(job, records, events) | touched
        if ingest.append_pg(session, job, records, events, summary, durable=durable):
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
        _upsert(
            session,
            Step.__table__,  # type: ignore[arg-type]
            [{"job_id": job_id, **r._asdict()} for r in records],
            ["job_id", "step"],
        )
    refresh_rollups(session, job_id, first, records[-1].step)
    events = scale_events(records, previous)
    _upsert(
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
    """Forget history from ``step`` on (a resumed attempt re-runs those steps) and recompute
    the summary from what remains, so it matches the rows exactly. When rows were forgotten,
    the job's ``history_version`` moves on, so that clients drop what they read from there."""
    forgotten = session.execute(delete(Step).where(Step.job_id == job.id, Step.step >= step))
    if forgotten.rowcount:  # type: ignore[attr-defined]
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


FLOAT32_MAX = 3.4028234663852886e38


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

# Steps per rollup block, by level; each level's block is 64 blocks of the level below.
LEVEL_BLOCKS = (64, 4096, 262144)


@dataclass
class Agg:
    """A mergeable summary of a set of steps."""

    first_step: int
    last_step: int
    count: int
    loss_min: float | None  # over finite losses; None when there are none
    loss_max: float | None
    scale_min: float
    scale_max: float
    overflow_count: int
    nonfinite_loss_count: int
    loss_last: float = math.nan
    scale_last: float = math.nan

    def merge(self, other: Agg) -> Agg:
        later = other if other.last_step > self.last_step else self
        return Agg(
            first_step=min(self.first_step, other.first_step),
            last_step=later.last_step,
            count=self.count + other.count,
            loss_min=_opt(min, self.loss_min, other.loss_min),
            loss_max=_opt(max, self.loss_max, other.loss_max),
            scale_min=min(self.scale_min, other.scale_min),
            scale_max=max(self.scale_max, other.scale_max),
            overflow_count=self.overflow_count + other.overflow_count,
            nonfinite_loss_count=self.nonfinite_loss_count + other.nonfinite_loss_count,
            loss_last=later.loss_last,
            scale_last=later.scale_last,
        )


def _opt(pick: Any, a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return float(pick(a, b))


def _agg_of_rows(rows: Sequence[Any]) -> Agg:
    """Summary of step rows (step, loss, loss_scale, finite), in step order."""
    finite_losses = [r[1] for r in rows if math.isfinite(r[1])]
    return Agg(
        first_step=rows[0][0],
        last_step=rows[-1][0],
        count=len(rows),
        loss_min=min(finite_losses) if finite_losses else None,
        loss_max=max(finite_losses) if finite_losses else None,
        scale_min=min(r[2] for r in rows),
        scale_max=max(r[2] for r in rows),
        overflow_count=sum(1 for r in rows if not r[3]),
        nonfinite_loss_count=len(rows) - len(finite_losses),
        loss_last=rows[-1][1],
        scale_last=rows[-1][2],
    )


def _rollup_row(job_id: int, level: int, block: int, agg: Agg) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "level": level,
        "block": block,
        "first_step": agg.first_step,
        "last_step": agg.last_step,
        "count": agg.count,
        "loss_min": agg.loss_min,
        "loss_max": agg.loss_max,
        "loss_last": agg.loss_last,
        "scale_min": agg.scale_min,
        "scale_max": agg.scale_max,
        "scale_last": agg.scale_last,
        "overflow_count": agg.overflow_count,
        "nonfinite_loss_count": agg.nonfinite_loss_count,
    }


def _agg_of_rollup(r: StepRollup) -> Agg:
    return Agg(
        first_step=r.first_step,
        last_step=r.last_step,
        count=r.count,
        loss_min=r.loss_min,
        loss_max=r.loss_max,
        scale_min=r.scale_min,
        scale_max=r.scale_max,
        overflow_count=r.overflow_count,
        nonfinite_loss_count=r.nonfinite_loss_count,
        loss_last=r.loss_last,
        scale_last=r.scale_last,
    )


_ROLLUP_COLUMNS = (
    "first_step, last_step, count, loss_min, loss_max, loss_last, "
    "scale_min, scale_max, scale_last, overflow_count, nonfinite_loss_count"
)
_ROLLUP_UPDATE = ", ".join(f"{c} = excluded.{c}" for c in _ROLLUP_COLUMNS.split(", "))
# PostgreSQL aggregates each level in the database, in one statement: level 0 from the step
# rows, each higher level from the one below. "Last" is the value at the greatest step.
_ROLLUP_FROM_STEPS_PG = text(
    f"""
    INSERT INTO step_rollup (job_id, level, block, {_ROLLUP_COLUMNS})
    SELECT :job_id, 0, step / :size, MIN(step), MAX(step), COUNT(*),
           MIN(loss) FILTER (WHERE loss BETWEEN -:fmax AND :fmax),
           MAX(loss) FILTER (WHERE loss BETWEEN -:fmax AND :fmax),
           (array_agg(loss ORDER BY step DESC))[1],
           MIN(loss_scale), MAX(loss_scale), (array_agg(loss_scale ORDER BY step DESC))[1],
           COUNT(*) FILTER (WHERE NOT finite),
           COUNT(*) FILTER (WHERE loss IS NULL OR NOT loss BETWEEN -:fmax AND :fmax)
    FROM step
    WHERE job_id = :job_id AND step BETWEEN :lo AND :hi
    GROUP BY step / :size
    ON CONFLICT (job_id, level, block) DO UPDATE SET {_ROLLUP_UPDATE}
    """
)
_ROLLUP_FROM_BELOW_PG = text(
    f"""
    INSERT INTO step_rollup (job_id, level, block, {_ROLLUP_COLUMNS})
    SELECT :job_id, :level, block / :per, MIN(first_step), MAX(last_step), SUM(count),
           MIN(loss_min), MAX(loss_max), (array_agg(loss_last ORDER BY block DESC))[1],
           MIN(scale_min), MAX(scale_max), (array_agg(scale_last ORDER BY block DESC))[1],
           SUM(overflow_count), SUM(nonfinite_loss_count)
    FROM step_rollup
    WHERE job_id = :job_id AND level = :below AND block BETWEEN :b0 AND :b1
    GROUP BY block / :per
    ON CONFLICT (job_id, level, block) DO UPDATE SET {_ROLLUP_UPDATE}
    """
)


def _refresh_rollups_pg(session: Session, job_id: int, lo: int, hi: int) -> None:
    size = LEVEL_BLOCKS[0]
    session.execute(
        _ROLLUP_FROM_STEPS_PG,
        {
            "job_id": job_id,
            "size": size,
            "lo": (lo // size) * size,
            "hi": (hi // size + 1) * size - 1,
            "fmax": FLOAT32_MAX,
        },
    )
    for level in range(1, len(LEVEL_BLOCKS)):
        size, per = LEVEL_BLOCKS[level], LEVEL_BLOCKS[level] // LEVEL_BLOCKS[level - 1]
        session.execute(
            _ROLLUP_FROM_BELOW_PG,
            {
                "job_id": job_id,
                "level": level,
                "below": level - 1,
                "per": per,
                "b0": (lo // size) * per,
                "b1": (hi // size + 1) * per - 1,
            },
        )


def refresh_rollups(session: Session, job_id: int, lo: int, hi: int) -> None:
    """Recompute the rollup blocks that cover steps ``lo..hi`` (after a write or a truncation).
    Reads at most the written rows plus two partial blocks, and 64 level-0 summaries per
    level-1 block. Blocks that end up empty are left to the caller (``truncate_after``
    deletes whatever lies past a cut)."""
    if session.get_bind().dialect.name == "postgresql":
        _refresh_rollups_pg(session, job_id, lo, hi)
        return
    table = StepRollup.__table__
    b0 = LEVEL_BLOCKS[0]
    first_block, last_block = lo // b0, hi // b0
    rows = session.execute(
        select(Step.step, Step.loss, Step.loss_scale, Step.finite)
        .where(
            Step.job_id == job_id,
            Step.step.between(first_block * b0, (last_block + 1) * b0 - 1),
        )
        .order_by(Step.step)
    ).all()
    by_block: dict[int, list[Any]] = {}
    for r in rows:
        by_block.setdefault(r[0] // b0, []).append(r)
    session.execute(
        delete(StepRollup).where(
            StepRollup.job_id == job_id,
            StepRollup.level == 0,
            StepRollup.block.between(first_block, last_block),
            StepRollup.block.not_in(list(by_block)),
        )
    )
    _upsert(
        session,
        table,  # type: ignore[arg-type]
        [_rollup_row(job_id, 0, b, _agg_of_rows(rs)) for b, rs in by_block.items()],
        ["job_id", "level", "block"],
    )
    for level in range(1, len(LEVEL_BLOCKS)):
        size, per = LEVEL_BLOCKS[level], LEVEL_BLOCKS[level] // LEVEL_BLOCKS[level - 1]
        first_block, last_block = lo // size, hi // size
        below = session.scalars(
            select(StepRollup)
            .where(
                StepRollup.job_id == job_id,
                StepRollup.level == level - 1,
                StepRollup.block.between(first_block * per, (last_block + 1) * per - 1),
            )
            .order_by(StepRollup.block)
        ).all()
        merged: dict[int, Agg] = {}
        for roll in below:
            key = roll.block // per
            agg = _agg_of_rollup(roll)
            merged[key] = merged[key].merge(agg) if key in merged else agg
        session.execute(
            delete(StepRollup).where(
                StepRollup.job_id == job_id,
                StepRollup.level == level,
                StepRollup.block.between(first_block, last_block),
                StepRollup.block.not_in(list(merged)),
            )
        )
        _upsert(
            session,
            table,  # type: ignore[arg-type]
            [_rollup_row(job_id, level, b, agg) for b, agg in merged.items()],
            ["job_id", "level", "block"],
        )


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


@dataclass(frozen=True)
class Bucket:
    index: int
    first_step: int
    last_step: int
    count: int
    loss_min: float | None
    loss_max: float | None
    loss_last: float
    scale_min: float
    scale_max: float
    scale_last: float
    overflow_count: int
    nonfinite_loss_count: int


@dataclass(frozen=True)
class Grid:
    """Bucket ``i`` holds steps ``origin + i*width .. origin + (i+1)*width - 1`` (within the
    requested range). When buckets are wide, ``width`` is a multiple of a rollup block and
    ``origin`` sits on the block grid, so buckets are unions of whole blocks except at the
    ends of the range."""

    origin: int
    width: int
    level: int | None


def grid_for(lo: int, hi: int, points: int) -> Grid:
    span = hi - lo + 1
    width = max(1, math.ceil(span / points))
    level = None
    for i, size in enumerate(LEVEL_BLOCKS):
        if size <= width:
            level = i
    if level is None:
        return Grid(origin=lo, width=width, level=None)
    size = LEVEL_BLOCKS[level]
    origin = (lo // size) * size
    width = math.ceil(math.ceil((hi - origin + 1) / points) / size) * size
    return Grid(origin=origin, width=width, level=level)


# One statement for both dialects: integer arithmetic truncates on PostgreSQL and SQLite
# alike (the CAST keeps PostgreSQL from overflowing int4), and the finite test is false for
# NULL (NaN) and for +/-inf.
_RAW_GROUPS = text(
    """
    SELECT CAST(step - :origin AS BIGINT) / :width AS b,
           MIN(step), MAX(step), COUNT(*),
           MIN(CASE WHEN loss BETWEEN -:fmax AND :fmax THEN loss END),
           MAX(CASE WHEN loss BETWEEN -:fmax AND :fmax THEN loss END),
           MIN(loss_scale), MAX(loss_scale),
           SUM(CASE WHEN finite THEN 0 ELSE 1 END),
           SUM(CASE WHEN loss BETWEEN -:fmax AND :fmax THEN 0 ELSE 1 END)
    FROM step
    WHERE job_id = :job_id AND step BETWEEN :lo AND :hi
    GROUP BY b
    """
)

_ROLLUP_GROUPS = text(
    """
    SELECT (CAST(block AS BIGINT) * :size - :origin) / :width AS b,
           MIN(first_step), MAX(last_step), SUM(count),
           MIN(loss_min), MAX(loss_max),
           MIN(scale_min), MAX(scale_max),
           SUM(overflow_count), SUM(nonfinite_loss_count)
    FROM step_rollup
    WHERE job_id = :job_id AND level = :level AND block BETWEEN :k0 AND :k1
    GROUP BY b
    """
)


def _one_of(session: Session, column: Any, values: list[int]) -> ColumnElement[bool]:
    """``column IN values`` (sorted, up to a few thousand), stated so the index range is
    used: PostgreSQL, given a long list alone, may scan all of the job's rows and filter them
    (100 ms on a million-step job, for a 1000-bucket zoom that otherwise takes 7 ms), so the
    list comes with its bounds, and as one array parameter rather than a thousand."""
    if not values:
        return column.in_([])  # type: ignore[no-any-return]
    bounded = column.between(values[0], values[-1])
    if session.get_bind().dialect.name == "postgresql":
        member = column == any_(bindparam("values", values, type_=postgresql.ARRAY(Integer)))
    else:
        member = column.in_(values)
    return bounded & member  # type: ignore[no-any-return]


def _groups(rows: Sequence[Any]) -> dict[int, Agg]:
    out = {}
    for b, first, last, count, lmin, lmax, smin, smax, overflows, nonfinite in rows:
        out[int(b)] = Agg(
            first_step=int(first),
            last_step=int(last),
            count=int(count),
            loss_min=None if lmin is None else float32(lmin),
            loss_max=None if lmax is None else float32(lmax),
            scale_min=float32(smin),
            scale_max=float32(smax),
            overflow_count=int(overflows),
            nonfinite_loss_count=int(nonfinite),
        )
    return out


def _raw_groups(session: Session, job_id: int, lo: int, hi: int, grid: Grid) -> dict[int, Agg]:
    if hi < lo:
        return {}
    rows = session.execute(
        _RAW_GROUPS,
        {
            "origin": grid.origin,
            "width": grid.width,
            "job_id": job_id,
            "lo": lo,
            "hi": hi,
            "fmax": FLOAT32_MAX,
        },
    ).all()
    groups = _groups(rows)
    lasts = {
        step: (loss, scale)
        for step, loss, scale in session.execute(
            select(Step.step, Step.loss, Step.loss_scale).where(
                Step.job_id == job_id,
                _one_of(session, Step.step, sorted(g.last_step for g in groups.values())),
            )
        )
    }
    for g in groups.values():
        g.loss_last, g.scale_last = lasts[g.last_step]
    return groups


def _rollup_groups(
    session: Session, job_id: int, level: int, k0: int, k1: int, grid: Grid
) -> dict[int, Agg]:
    if k1 < k0:
        return {}
    size = LEVEL_BLOCKS[level]
    rows = session.execute(
        _ROLLUP_GROUPS,
        {
            "size": size,
            "origin": grid.origin,
            "width": grid.width,
            "job_id": job_id,
            "level": level,
            "k0": k0,
            "k1": k1,
        },
    ).all()
    groups = _groups(rows)
    blocks = sorted(g.last_step // size for g in groups.values())
    lasts = {
        block: (loss, scale)
        for block, loss, scale in session.execute(
            select(StepRollup.block, StepRollup.loss_last, StepRollup.scale_last).where(
                StepRollup.job_id == job_id,
                StepRollup.level == level,
                _one_of(session, StepRollup.block, blocks),
            )
        )
    }
    for g in groups.values():
        g.loss_last, g.scale_last = lasts[g.last_step // size]
    return groups


def buckets(session: Session, job_id: int, *, lo: int, hi: int, points: int) -> list[Bucket]:
    """At most ``points`` buckets over steps ``lo..hi``, each with min/max/last of loss and
    scale and its overflow and non-finite-loss counts; empty buckets are left out. Wide
    buckets come from the rollups (plus raw rows for the partial blocks at the two ends of the
    range), narrow ones straight from the step rows; both in SQL, one index range each."""
    if hi < lo:
        return []
    grid = grid_for(lo, hi, points)
    if grid.level is None:
        groups = _raw_groups(session, job_id, lo, hi, grid)
    else:
        size = LEVEL_BLOCKS[grid.level]
        k0 = -(-lo // size)  # first block wholly inside the range
        k1 = (hi + 1) // size - 1  # last block wholly inside the range
        if k1 < k0:
            groups = _raw_groups(session, job_id, lo, hi, grid)
        else:
            groups = _rollup_groups(session, job_id, grid.level, k0, k1, grid)
            for edge in (
                _raw_groups(session, job_id, lo, k0 * size - 1, grid),
                _raw_groups(session, job_id, (k1 + 1) * size, hi, grid),
            ):
                for b, agg in edge.items():
                    groups[b] = groups[b].merge(agg) if b in groups else agg
    return [
        Bucket(
            index=b,
            first_step=g.first_step,
            last_step=g.last_step,
            count=g.count,
            loss_min=g.loss_min,
            loss_max=g.loss_max,
            loss_last=g.loss_last,
            scale_min=g.scale_min,
            scale_max=g.scale_max,
            scale_last=g.scale_last,
            overflow_count=g.overflow_count,
            nonfinite_loss_count=g.nonfinite_loss_count,
        )
        for b, g in sorted(groups.items())
    ]
