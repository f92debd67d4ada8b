"""History at scale, measured on one job of N steps (default one million), on SQLite or
PostgreSQL, side by side where a comparison makes sense:

- ingest: steps/s through the worker's write path (``history.write_steps`` in one write
  transaction per batch, rollups and events kept current), batches of --batch rows (what a
  fast job accumulates between two flushes);
- bytes per step on PostgreSQL (table, primary key, rollups, events);
- through the HTTP API (uvicorn in this process): ``points=1000`` over the whole job, a
  1,000-row ``after_step`` page at the tail, a 304 poll of the job (If-None-Match), all with
  the poll cache off, i.e. every answer from the database; and the 304 polls per second one
  API process sustains with its poll cache on (with wrk when installed);
- the zoomed-out buckets from the rollups against the same buckets from every step row.

    .venv/bin/python benchmarks/history.py                  # SQLite
    .venv/bin/python benchmarks/history.py --database-url postgresql://root@127.0.0.1:5432/test

The database named by --database-url is wiped (its tables dropped and recreated).
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from sqlalchemy import text

from service import auth, history, jobs, migrate
from service.app import create_app
from service.db import Database
from service.history import StepRecord
from service.models import Job, utcnow
from service.schemas import JobSpec, SubmitResult
from service.settings import Settings


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


class Served:
    """The real app under uvicorn in this process, on a free port."""

    def __init__(self, db: Database, home: Path, poll_cache_seconds: float) -> None:
        settings = Settings(
            home=home,
            database_url=db.engine.url.render_as_string(hide_password=False),
            poll_cache_seconds=poll_cache_seconds,
        )
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(settings, db, auth=True),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                log_config=None,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def polls_per_second(
    url: str, path: str, headers: dict[str, str], seconds: float
) -> tuple[float, str]:
    """304 polls per second one API process answers: wrk (50 connections) when installed,
    else four Python threads (which then also measure this client)."""
    if shutil.which("wrk"):
        args = ["wrk", "-t1", "-c50", f"-d{int(seconds)}s"]
        for name, value in headers.items():
            args += ["-H", f"{name}: {value}"]
        out = subprocess.run([*args, url + path], capture_output=True, text=True, check=True)
        rate = next(x for x in out.stdout.splitlines() if x.startswith("Requests/sec"))
        return float(rate.split()[1]), "wrk, 50 connections"
    done = [0]
    stop = time.perf_counter() + seconds

    def hammer() -> None:
        with httpx.Client(base_url=url, headers=headers) as client:
            while time.perf_counter() < stop:
                client.get(path)
                done[0] += 1

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0] / seconds, "4 Python threads"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--points", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp())
    url = args.database_url or f"sqlite:///{home / 'bench.db'}"
    db = Database.connect(url)
    if db.dialect == "postgresql":
        with db.engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    migrate.upgrade(db.engine)
    with db.write() as s:
        token = auth.add_user(s, "bench", admin=True)
        job_id = jobs.create_job(
            s,
            owner="bench",
            submitted=SubmitResult(spec=JobSpec(), warnings=[], notes=[]),
            now=utcnow(),
        ).id

    records = synthetic(args.steps)
    start = time.perf_counter()
    for i in range(0, len(records), args.batch):
        with db.write() as s:
            job = s.get(Job, job_id)
            assert job is not None
            history.write_steps(s, job, records[i : i + args.batch], now=utcnow())
    ingest = args.steps / (time.perf_counter() - start)
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

    # Same answer both ways, or the comparison means nothing.
    a = {b.index: (b.first_step, b.last_step, b.count, b.overflow_count) for b in served()}
    b = {k: (g.first_step, g.last_step, g.count, g.overflow_count) for k, g in from_rows().items()}
    assert a == b, "rollups and rows disagree"
    t_served = timed(served, args.repeat)
    t_rows = timed(from_rows, max(3, args.repeat // 3))

    headers = {"Authorization": f"Bearer {token}"}
    direct = Served(db, home, poll_cache_seconds=0)
    with httpx.Client(base_url=direct.url, headers=headers, timeout=60) as http:
        etag = http.get(f"/v1/jobs/{job_id}").headers["etag"]

        # The timed requests do not parse the JSON: that is the client's cost, not the API's.
        # It is checked once here.
        buckets_params = {"points": args.points}
        tail_params = {"after_step": hi - 1000, "limit": 1000}
        history_path = f"/v1/jobs/{job_id}/history"
        assert len(http.get(history_path, params=buckets_params).json()["buckets"]) == len(a)
        assert len(http.get(history_path, params=tail_params).json()["items"]) == 1000

        def buckets_http() -> Any:
            assert http.get(history_path, params=buckets_params).status_code == 200

        def tail_page() -> Any:
            assert http.get(history_path, params=tail_params).status_code == 200

        def poll_304() -> Any:
            assert (
                http.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": etag}).status_code == 304
            )

        t_buckets = timed(buckets_http, args.repeat)
        t_tail = timed(tail_page, args.repeat)
        t_304 = timed(poll_304, args.repeat * 5)
    direct.stop()
    cached = Served(db, home, poll_cache_seconds=0.5)
    rate, how = polls_per_second(
        cached.url, f"/v1/jobs/{job_id}", {**headers, "If-None-Match": etag}, seconds=10
    )
    cached.stop()

    def row(what: str, value: str, target: str = "") -> None:
        print(f"  {what:58s} {value:>14s}  {target}")

    print(f"database: {db.dialect}; one job of {args.steps:,} steps")
    row(
        f"ingest, worker write path (batches of {args.batch:,})",
        f"{ingest:,.0f} steps/s",
        "(PostgreSQL target >= 200,000)",
    )
    if db.dialect == "postgresql":
        with db.engine.connect() as conn:
            sizes = {
                table: conn.execute(text(f"SELECT pg_total_relation_size('{table}')")).scalar() or 0
                for table in ("step", "step_rollup", "scale_event")
            }
        per_step = sum(sizes.values()) / args.steps
        detail = ", ".join(f"{t} {v / args.steps:.1f}" for t, v in sizes.items())
        row("bytes per step", f"{per_step:.1f}", f"(target <= 120; {detail})")
    row(
        f"HTTP points={args.points} over the whole job",
        f"{t_buckets * 1000:.1f} ms",
        "(target <= 60 ms)",
    )
    row(
        "HTTP 1,000-row after_step page at the tail", f"{t_tail * 1000:.1f} ms", "(target <= 10 ms)"
    )
    row("HTTP 304 poll of the job", f"{t_304 * 1000:.2f} ms", "(target <= 3 ms)")
    row(f"304 polls/s, one API process ({how})", f"{rate:,.0f}/s")
    row(f"{len(a)} buckets in SQL: from rollups", f"{t_served * 1000:.1f} ms")
    row(
        f"{len(a)} buckets in SQL: from every step row",
        f"{t_rows * 1000:.1f} ms",
        f"({t_rows / t_served:.0f}x the rollups)",
    )
    db.dispose()


if __name__ == "__main__":
    main()
