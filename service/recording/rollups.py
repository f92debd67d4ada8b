"""Rollups and buckets: a job's history cut into at most P ranges, each summarized (first/last
step, min/max/last loss and scale, overflow and non-finite-loss counts) so that no spike and no
overflow is averaged away, served from four levels of pre-summarized blocks. Step writes,
truncation and raw reads are in service/recording/history.py."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import (
    delete,
    select,
    text,
)
from sqlalchemy.orm import Session

from service.database.db import upsert
from service.database.models import FLOAT32_MAX, Step, StepRollup

# Steps per rollup block, by level; each level's block is 16 blocks of the level below, so a
# bucket is at most 16 blocks of the level it is read from (migration 0007 explains).
LEVEL_BLOCKS = (64, 1024, 16384, 262144)


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
    Reads at most the written rows plus two partial blocks, and 16 summaries of the level
    below per block of the levels above. Blocks that end up empty are left to the caller
    (``truncate_after`` deletes whatever lies past a cut)."""
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
    upsert(
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
        upsert(
            session,
            table,  # type: ignore[arg-type]
            [_rollup_row(job_id, level, b, agg) for b, agg in merged.items()],
            ["job_id", "level", "block"],
        )


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
    # Rounded up, the width may be whole blocks of a coarser level too (1000 points over a
    # million steps: 1024 steps, 16 level-0 blocks or one level-1 block): read those.
    while (
        level + 1 < len(LEVEL_BLOCKS)
        and width % LEVEL_BLOCKS[level + 1] == 0
        and origin % LEVEL_BLOCKS[level + 1] == 0
    ):
        level += 1
    return Grid(origin=origin, width=width, level=level)


# One statement for both dialects: integer arithmetic truncates on PostgreSQL and SQLite
# alike (the CAST keeps PostgreSQL from overflowing int4), and the finite test is false for
# NULL (NaN) and for +/-inf. Each bucket's last loss and scale come from its last row in the
# same statement, by subqueries on the whole key: one index probe each, whatever the
# planner's statistics say. (A join on the same key, planned for a table not analyzed yet,
# scanned all of the job's rollups once per bucket.)
_RAW_GROUPS = text(
    """
    WITH g AS (
        SELECT CAST(step - :origin AS BIGINT) / :width AS b,
               MIN(step) AS first_step, MAX(step) AS last_step, COUNT(*) AS n,
               MIN(CASE WHEN loss BETWEEN -:fmax AND :fmax THEN loss END) AS loss_min,
               MAX(CASE WHEN loss BETWEEN -:fmax AND :fmax THEN loss END) AS loss_max,
               MIN(loss_scale) AS scale_min, MAX(loss_scale) AS scale_max,
               SUM(CASE WHEN finite THEN 0 ELSE 1 END) AS overflows,
               SUM(CASE WHEN loss BETWEEN -:fmax AND :fmax THEN 0 ELSE 1 END) AS nonfinite
        FROM step
        WHERE job_id = :job_id AND step BETWEEN :lo AND :hi
        GROUP BY b
    )
    SELECT g.b, g.first_step, g.last_step, g.n, g.loss_min, g.loss_max, g.scale_min,
           g.scale_max, g.overflows, g.nonfinite,
           (SELECT loss FROM step WHERE job_id = :job_id AND step = g.last_step),
           (SELECT loss_scale FROM step WHERE job_id = :job_id AND step = g.last_step)
    FROM g
    """
)


_ROLLUP_GROUPS = text(
    """
    WITH g AS (
        SELECT (CAST(block AS BIGINT) * :size - :origin) / :width AS b,
               MIN(first_step) AS first_step, MAX(last_step) AS last_step, SUM(count) AS n,
               MIN(loss_min) AS loss_min, MAX(loss_max) AS loss_max,
               MIN(scale_min) AS scale_min, MAX(scale_max) AS scale_max,
               SUM(overflow_count) AS overflows, SUM(nonfinite_loss_count) AS nonfinite
        FROM step_rollup
        WHERE job_id = :job_id AND level = :level AND block BETWEEN :k0 AND :k1
        GROUP BY b
    )
    SELECT g.b, g.first_step, g.last_step, g.n, g.loss_min, g.loss_max, g.scale_min,
           g.scale_max, g.overflows, g.nonfinite,
           (SELECT loss_last FROM step_rollup
            WHERE job_id = :job_id AND level = :level AND block = g.last_step / :size),
           (SELECT scale_last FROM step_rollup
            WHERE job_id = :job_id AND level = :level AND block = g.last_step / :size)
    FROM g
    """
)


def _groups(rows: Sequence[Any]) -> dict[int, Agg]:
    """Agg by bucket from the grouping statements' rows. PostgreSQL sends a REAL as its
    shortest decimal text, so each is rounded back to its float32 (as ``models.float32``
    does), a column at a time. NULL becomes NaN: "no finite loss" for a min or a max, and
    NaN itself for a last loss (``NanAsNullReal``)."""
    if not rows:
        return {}
    b, first, last, count, lmin, lmax, smin, smax, overflows, nonfinite, lla, sla = zip(
        *rows, strict=True
    )
    lmin, lmax, smin, smax, lla, sla = (
        np.array(c, np.float32).tolist() for c in (lmin, lmax, smin, smax, lla, sla)
    )
    return {
        int(b[i]): Agg(
            first_step=int(first[i]),
            last_step=int(last[i]),
            count=int(count[i]),
            loss_min=None if math.isnan(lmin[i]) else lmin[i],
            loss_max=None if math.isnan(lmax[i]) else lmax[i],
            scale_min=smin[i],
            scale_max=smax[i],
            overflow_count=int(overflows[i]),
            nonfinite_loss_count=int(nonfinite[i]),
            loss_last=lla[i],
            scale_last=sla[i],
        )
        for i in range(len(b))
    }


def _raw_groups(session: Session, job_id: int, lo: int, hi: int, grid: Grid) -> dict[int, Agg]:
    if hi < lo:
        return {}
    params = {"origin": grid.origin, "width": grid.width, "job_id": job_id, "lo": lo, "hi": hi}
    rows = session.execute(_RAW_GROUPS, params | {"fmax": FLOAT32_MAX}).all()
    return _groups(rows)


def _rollup_groups(
    session: Session, job_id: int, level: int, k0: int, k1: int, grid: Grid
) -> dict[int, Agg]:
    if k1 < k0:
        return {}
    params = {"size": LEVEL_BLOCKS[level], "origin": grid.origin, "width": grid.width}
    params |= {"job_id": job_id, "level": level, "k0": k0, "k1": k1}
    return _groups(session.execute(_ROLLUP_GROUPS, params).all())


def _covered(
    session: Session, job_id: int, lo: int, hi: int, grid: Grid, level: int
) -> dict[int, Agg]:
    """Steps ``lo..hi`` by bucket, from the blocks of ``level`` wholly inside the range, and
    for the two ends, which cover part of such a block, from the level below, down to the
    step rows below level 0 (level -1). A block of a level at or below the grid's lies in one
    bucket, since its size divides the grid's width and origin."""
    if hi < lo:
        return {}
    if level < 0:
        return _raw_groups(session, job_id, lo, hi, grid)
    size = LEVEL_BLOCKS[level]
    k0 = -(-lo // size)  # first block wholly inside the range
    k1 = (hi + 1) // size - 1  # last block wholly inside the range
    if k1 < k0:
        return _covered(session, job_id, lo, hi, grid, level - 1)
    groups = _rollup_groups(session, job_id, level, k0, k1, grid)
    for end in (
        _covered(session, job_id, lo, k0 * size - 1, grid, level - 1),
        _covered(session, job_id, (k1 + 1) * size, hi, grid, level - 1),
    ):
        for b, agg in end.items():
            groups[b] = groups[b].merge(agg) if b in groups else agg
    return groups


def buckets(session: Session, job_id: int, *, lo: int, hi: int, points: int) -> list[Bucket]:
    """At most ``points`` buckets over steps ``lo..hi``, each with min/max/last of loss and
    scale and its overflow and non-finite-loss counts; empty buckets are left out. Wide
    buckets come from the rollups (``_covered``), narrow ones straight from the step rows;
    both in SQL, one index range a statement."""
    if hi < lo:
        return []
    if session.get_bind().dialect.name == "postgresql":
        # A plan for these bounds at every run: psycopg prepares a statement after its fifth
        # run, and PostgreSQL may then keep a generic plan, made without the values (one such
        # plan scanned all of a job's rows). And no JIT: with statistics the planner counts the
        # per-bucket subqueries once per estimated group, past jit_above_cost, and compiling
        # then took longer than the whole read.
        session.execute(
            text(
                "SELECT set_config('plan_cache_mode', 'force_custom_plan', true),"
                " set_config('jit', 'off', true)"
            )
        )
    grid = grid_for(lo, hi, points)
    groups = _covered(session, job_id, lo, hi, grid, -1 if grid.level is None else grid.level)
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
