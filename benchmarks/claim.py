"""The claim's time with a long queue: 10,000 queued jobs from 100 users (by default), a few of
them running, every user with recorded use. Prints, side by side in one run for each database,
the median time of one claim (the whole statement, in a transaction that is then rolled back,
so every claim sees the same queue) with

- today's order before fair share (priority, the owner's running jobs, age), kept here as the
  baseline: ``baseline_claim``;
- the fair-share order (``service.scheduling.jobs.claim_next``: priority, usage / weight, running
  jobs, age);
- the same with a budget of slot-hours per window (``HALFWAY_BUDGET_SLOT_HOURS``), about half
  of the users over it;

in interleaved rounds (baseline, fair share, budget, baseline, ...), their ratios, and the
time of the whole queue's positions (``service.scheduling.fairshare.queue``, what ``GET /v1/queue``
reads), without and with the budget.

    .venv/bin/python benchmarks/claim.py
    .venv/bin/python benchmarks/claim.py --databases sqlite,postgresql://root@127.0.0.1:5432/bench_claim

Each PostgreSQL database named is wiped (its tables dropped and recreated).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, or_, select, update
from sqlalchemy.orm import Session, aliased

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results
from history import fresh_database

from service.database.db import Database
from service.database.dbclock import db_now
from service.database.models import Job, UserUsage, utcnow
from service.scheduling import fairshare, jobs
from service.specs.schemas import JobSpec


def baseline_claim(session: Session, worker_id: str) -> int | None:
    """The claim as it was before fair share (service/scheduling/jobs.py at 0008), for
    comparison."""
    other = aliased(Job)
    running_for_owner = (
        select(func.count())
        .where(
            other.owner == Job.owner,
            other.status == "running",
            other.lease_expires_at >= db_now(),
        )
        .correlate(Job)
        .scalar_subquery()
    )
    candidate = (
        select(Job.id)
        .where(fairshare.claimable(), or_(Job.gpus.is_(None), Job.gpus <= 0))
        .order_by(Job.priority.desc(), running_for_owner, Job.created_at, Job.id)
        .limit(1)
        .with_for_update(skip_locked=True, of=Job)
    )
    row = session.execute(
        update(Job)
        .where(Job.id == candidate.scalar_subquery(), fairshare.claimable())
        .values(
            status="running",
            worker_id=worker_id,
            lease_expires_at=db_now(30),
            attempt=Job.attempt + 1,
            started_at=func.coalesce(Job.started_at, db_now()),
            updated_at=db_now(),
        )
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    return None if row is None else int(row[0])


BUDGET = fairshare.Rule(budget_seconds=40 * 3600.0)  # 40 slot-hours a week


def fair_claim(session: Session, worker_id: str) -> int | None:
    claim = jobs.claim_next(session, worker_id=worker_id, lease_seconds=30, gpus_held=0)
    return None if claim is None else claim.job_id


def budget_claim(session: Session, worker_id: str) -> int | None:
    claim = jobs.claim_next(
        session, worker_id=worker_id, lease_seconds=30, gpus_held=0, rule=BUDGET
    )
    return None if claim is None else claim.job_id


def fill(db: Database, users: int, queued: int, running: int) -> None:
    """``queued`` jobs round the users, in random order of age; ``running`` of them claimed;
    every user with some recorded use, recorded at different times, and this budget window's
    use between none and twice the budget (the first user's none)."""
    rng = random.Random(7)
    spec = JobSpec().model_dump(mode="json")
    now = utcnow()
    window = int((now - fairshare.WINDOW_ORIGIN).total_seconds() // BUDGET.window_seconds)
    rows: list[dict[str, Any]] = []
    for i in range(queued):
        owner = f"user{i % users:03d}"
        created = now - timedelta(seconds=rng.uniform(0, 86400))
        rows.append(
            {
                "owner": owner,
                "name": "job",
                "status": "queued",
                "spec": spec,
                "warnings": [],
                "notes": [],
                "priority": rng.choice((50, 50, 50, 60)),
                "attempt": 0,
                "max_attempts": 3,
                "cancel_requested": False,
                "attempt_errors": [],
                "created_at": created,
                "updated_at": created,
                "overflow_count": 0,
                "growth_count": 0,
                "backoff_count": 0,
                "nonfinite_loss_count": 0,
                "metrics": {},
                "precision_report": [],
                "forensics": [],
                "device": {},
            }
        )
    with db.write() as s:
        s.execute(insert(Job), rows)
        s.execute(
            insert(UserUsage),
            [
                {
                    "owner": f"user{u:03d}",
                    "weight": rng.choice((1.0, 1.0, 2.0)),
                    "usage_seconds": rng.uniform(0, 50_000),
                    "as_of": now - timedelta(seconds=rng.uniform(0, 3600)),
                    "window_index": window,
                    "window_used": 0.0 if u == 0 else rng.uniform(0, 2 * BUDGET.budget_seconds),
                }
                for u in range(users)
            ],
        )
    for i in range(running):
        with db.write() as s:
            fair_claim(s, f"runner{i}")
    with db.engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE")  # both databases: plans for the tables as filled


def timed(db: Database, claim: Callable[[Session, str], int | None]) -> float:
    with db.write_sessions() as s, s.begin():
        start = time.perf_counter()
        got = claim(s, "bench")
        took = time.perf_counter() - start
        assert got is not None
        s.rollback()
    return took


def bench(url: str, users: int, queued: int, running: int, rounds: int, per_round: int) -> None:
    db = fresh_database(url, Path(tempfile.mkdtemp()))
    print(f"{db.dialect}: {queued} queued jobs from {users} users, {running} running", flush=True)
    fill(db, users, queued, running)
    with db.write_sessions() as s, s.begin():
        assert baseline_claim(s, "w") is not None  # warm both statements' plans and caches
        s.rollback()
    timed(db, fair_claim)
    timed(db, budget_claim)
    claims = (("baseline", baseline_claim), ("fair", fair_claim), ("budget", budget_claim))
    times: dict[str, list[float]] = {name: [] for name, _ in claims}
    times.update(positions=[], budget_positions=[])
    for _ in range(rounds):
        for name, claim in claims:
            times[name].append(statistics.median(timed(db, claim) for _ in range(per_round)))
        for name, rule in (("positions", fairshare.Rule()), ("budget_positions", BUDGET)):
            with db.read() as s:
                start = time.perf_counter()
                places = fairshare.queue(s, rule)
                times[name].append(time.perf_counter() - start)
            assert len(places) == queued - running
    med = {name: statistics.median(values) for name, values in times.items()}
    print(f"  claim, today's order       {med['baseline'] * 1000:8.2f} ms")
    print(f"  claim, fair-share order    {med['fair'] * 1000:8.2f} ms")
    print(f"  fair share / today's       {med['fair'] / med['baseline']:8.2f}x")
    print(f"  claim, with a budget       {med['budget'] * 1000:8.2f} ms")
    print(f"  budget / fair share        {med['budget'] / med['fair']:8.2f}x")
    print(f"  the whole queue's places   {med['positions'] * 1000:8.2f} ms")
    print(f"  the same, with a budget    {med['budget_positions'] * 1000:8.2f} ms", flush=True)
    db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--databases", default="sqlite", help="'sqlite' and/or PostgreSQL URLs.")
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--running", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=5)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for url in args.databases.split(","):
        bench(url, args.users, args.jobs, args.running, args.rounds, args.per_round)


if __name__ == "__main__":
    results.run(main)
