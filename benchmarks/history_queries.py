"""History at scale, measured side by side on one job of N steps (default one million):

- the zoomed-out bucket query (P buckets over the whole job) as Halfway serves it, from the
  rollups, against the same buckets computed from every step row (what a GROUP BY without
  rollups costs): the ratio is the rollups' speed-up;
- a zoom into 10,000 steps, and an ``after_step`` poll at the end of the job;
- on PostgreSQL, the bytes each step takes (table, primary key, rollups, events).

    .venv/bin/python benchmarks/history_queries.py                  # SQLite
    .venv/bin/python benchmarks/history_queries.py --database-url postgresql://root@127.0.0.1:5432/test

The database named by --database-url is wiped (its tables dropped and recreated).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text

from service import history, jobs, migrate
from service.db import Database
from service.history import StepRecord
from service.models import Job, utcnow
from service.schemas import JobSpec, SubmitResult


def synthetic(n: int, seed: int = 0) -> list[StepRecord]:
    rng = random.Random(seed)
    scale, out = 32768.0, []
    for step in range(n):
        finite = rng.random() > 0.001
        loss = math.nan if rng.random() < 0.0002 else float(int(rng.random() * 2**20)) / 2**16
        out.append(StepRecord(step, step // 1000, loss, scale, finite))
        if not finite:
            scale = max(1.0, scale / 2)
        elif step % 2000 == 1999:
            scale = min(2.0**24, scale * 2)
    return out


def timed(fn: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--points", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    url = args.database_url or f"sqlite:///{Path(tempfile.mkdtemp()) / 'bench.db'}"
    db = Database.connect(url)
    if db.dialect == "postgresql":
        with db.engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    migrate.upgrade(db.engine)
    with db.write() as s:
        job_id = jobs.create_job(
            s,
            owner="bench",
            submitted=SubmitResult(spec=JobSpec(), warnings=[], notes=[]),
            now=utcnow(),
        ).id

    records = synthetic(args.steps)
    batch = 2000  # about what a supervisor writes per flush for a fast job
    start = time.perf_counter()
    for i in range(0, len(records), batch):
        with db.write() as s:
            job = s.get(Job, job_id)
            assert job is not None
            history.write_steps(s, job, records[i : i + batch], now=utcnow())
    write_s = time.perf_counter() - start
    if db.dialect == "postgresql":
        with db.engine.connect() as conn:
            conn.execute(text("ANALYZE"))

    hi = args.steps - 1
    grid = history.grid_for(0, hi, args.points)

    def served() -> Any:
        with db.read() as s:
            return history.buckets(s, job_id, lo=0, hi=hi, points=args.points)

    def from_rows() -> Any:
        with db.read() as s:
            return history._raw_groups(s, job_id, 0, hi, grid)

    def zoom() -> Any:
        with db.read() as s:
            return history.buckets(s, job_id, lo=hi // 2, hi=hi // 2 + 9999, points=args.points)

    def poll() -> Any:
        with db.read() as s:
            return history.read_steps(s, job_id, after_step=hi, limit=1000)

    # Same answer both ways, or the comparison means nothing.
    a = {b.index: (b.first_step, b.last_step, b.count, b.overflow_count) for b in served()}
    b = {k: (g.first_step, g.last_step, g.count, g.overflow_count) for k, g in from_rows().items()}
    assert a == b, "rollups and rows disagree"

    t_served = timed(served, args.repeat)
    t_rows = timed(from_rows, max(3, args.repeat // 2))
    t_zoom = timed(zoom, args.repeat)
    t_poll = timed(poll, args.repeat * 5)

    print(f"database: {db.dialect}; one job of {args.steps:,} steps")
    print(
        f"history writes: {args.steps / write_s:,.0f} rows/s "
        f"(batches of {batch}, rollups kept current)"
    )
    print(f"{len(a)} buckets over the whole job (width {grid.width} steps):")
    print(f"  served from rollups      {t_served * 1000:8.1f} ms")
    print(f"  computed from every row  {t_rows * 1000:8.1f} ms")
    print(f"  ratio rows / rollups     {t_rows / t_served:8.1f}x")
    print(f"zoom into 10,000 steps     {t_zoom * 1000:8.1f} ms")
    print(f"after_step poll at the end {t_poll * 1000:8.2f} ms")
    if db.dialect == "postgresql":
        with db.engine.connect() as conn:
            sizes = {
                table: conn.execute(text(f"SELECT pg_total_relation_size('{table}')")).scalar() or 0
                for table in ("step", "step_rollup", "scale_event")
            }
        total = sum(sizes.values())
        detail = ", ".join(f"{t} {v / args.steps:.1f}" for t, v in sizes.items())
        print(f"PostgreSQL bytes per step: {total / args.steps:.1f} ({detail})")
    db.dispose()


if __name__ == "__main__":
    main()
