"""History at scale, on SQLite and PostgreSQL in one run, for jobs of each --steps size:

- ingest: steps/s through the worker's write path (``Supervisor._sync``, what the supervisor
  runs per flush: the fenced lease renewal, the rows, rollups, scale events and summary in
  one transaction), at 333-row batches (what a job flushes every 0.5 s) and at 10,000;
- the whole history through HTTP, from a real ``halfway serve`` process (poll cache off, so
  every answer comes from the database): JSON pages of 10,000 rows, ``format=columns``
  pages of up to 1,000,000, CSV, Arrow and Parquet; the time to receive every byte and the
  time to have the rows decoded into columns in the client, with ratios against JSON pages;
- ``points=1000`` over the whole job, a 1,000-row ``after_step`` page at the tail, a 304
  poll of the job, through HTTP; and ``points=1000`` under the production defaults (the poll
  cache and the lean path on), as a dashboard meets it: the first read of each snapshot, and
  the same page again within it;
- bytes per step on PostgreSQL, and the zoomed-out buckets from the rollups against the same
  buckets from every step row.

    .venv/bin/python benchmarks/history.py \\
        --databases sqlite,postgresql://root@127.0.0.1:5432/bench --steps 100000,1000000

``--only ingest`` measures the ingest alone (``--repeat`` times at each batch size, each
figure printed, then the median and the spread).

Each PostgreSQL database named is wiped (its tables dropped and recreated).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import results
from sqlalchemy import text

from service.database import migrate
from service.database.db import Database
from service.database.models import utcnow
from service.people import auth
from service.recording import rollups
from service.recording.records import StepRecord
from service.scheduling import jobs
from service.settings import Settings
from service.specs.schemas import JobSpec, SubmitResult
from workers.attempt import Attempt
from workers.supervisor import Supervisor

HALFWAY = str(Path(sys.executable).parent / "halfway")


def synthetic(n: int, seed: int = 0) -> list[StepRecord]:
    """A loss-scale history: overflows (the scale halves), growth every 2000 good steps,
    some NaN losses; float32-exact values, as TensorFlow produces."""
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


# Bucket reads are timed after this many on the same connection: psycopg prepares a statement
# at its fifth run and PostgreSQL plans it for its values five times more, then may keep a
# generic plan. A server that has run for a while is there; the first reads are not.
STEADY = 12
CACHE_SECONDS = 0.5  # the poll cache's default age (HALFWAY_POLL_CACHE_SECONDS)


def timed(fn: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fresh_database(url: str, home: Path) -> Database:
    if url == "sqlite":
        url = f"sqlite:///{home / 'bench.db'}"
    db = Database.connect(url)
    if db.dialect == "postgresql":
        with db.engine.begin() as conn:
            conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    migrate.upgrade(db.engine)
    return db


def new_job(db: Database) -> int:
    with db.write() as s:
        return jobs.create_job(
            s,
            owner="bench",
            submitted=SubmitResult(spec=JobSpec(), warnings=[], notes=[]),
            now=utcnow(),
        ).id


def ingest(
    db: Database, settings: Settings, records: list[StepRecord], batch: int
) -> tuple[float, int]:
    """Steps/s through the supervisor's flush, one claimed job, batches of ``batch`` rows."""
    job_id = new_job(db)
    supervisor = Supervisor(db, settings, worker_id="bench")
    with db.write() as s:
        claim = jobs.claim_next(s, worker_id="bench", lease_seconds=600, gpus_held=0)
        assert claim is not None and claim.job_id == job_id
    run = Attempt(job_id=job_id, attempt=1)
    start = time.perf_counter()
    for i in range(0, len(records), batch):
        run.pending = records[i : i + batch]
        while not supervisor._sync(run):  # the database went away: the rows stay pending
            print("  (the database was unreachable; this ingest figure is void)", flush=True)
            time.sleep(1)
        assert not run.lease_lost
    rate = len(records) / (time.perf_counter() - start)
    with db.write() as s:
        assert jobs.finish(s, job_id=job_id, worker_id="bench", status="succeeded")
    return rate, job_id


@contextmanager
def served(url: str, home: Path, cache_seconds: float = 0) -> Iterator[str]:
    """A real ``halfway serve`` (no worker; no poll cache unless ``cache_seconds``) on a free
    port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "HALFWAY_HOME": str(home),
        "HALFWAY_DATABASE_URL": url,
        "HALFWAY_POLL_CACHE_SECONDS": str(cache_seconds),
    }
    process = subprocess.Popen(
        [HALFWAY, "serve", "--no-worker", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and process.poll() is None, "no server"
            time.sleep(0.2)
        yield base
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def get(http: httpx.Client, path: str, **kw: Any) -> httpx.Response:
    """GET, riding out a database restart (503) on this shared machine, saying so."""
    for _ in range(60):
        r = http.get(path, **kw)
        if r.status_code != 503:
            assert r.status_code in (200, 304), r.text
            return r
        print("  (the database was unreachable; this figure is void)", flush=True)
        time.sleep(1)
    raise AssertionError("the database stayed unreachable")


def readers(http: httpx.Client, job_id: int) -> dict[str, tuple[Callable[[], int], Any]]:
    """Per format: a function that receives every byte (returns the byte count), and one that
    turns the received bytes into columns."""
    base = f"/v1/jobs/{job_id}/history"

    def pages(path: str, params: dict[str, Any], rows_of: Callable[[Any], int]) -> list[bytes]:
        bodies, after = [], -1
        while True:
            r = get(http, path, params={**params, "after_step": after})
            bodies.append(r.content)
            page = json.loads(r.content)
            rows_of(page)
            after = page["next_after_step"]
            if not page["has_more"]:
                return bodies

    def whole(path: str) -> bytes:
        return get(http, path).content

    fetched: dict[str, Any] = {}

    def fetch(name: str, get: Callable[[], Any]) -> Callable[[], int]:
        def run() -> int:
            fetched[name] = get()
            body = fetched[name]
            return sum(map(len, body)) if isinstance(body, list) else len(body)

        return run

    def rows_from_pages() -> Any:
        cols: dict[str, list[Any]] = {k: [] for k in ("step", "loss", "loss_scale", "finite")}
        for body in fetched["JSON pages"]:
            for item in json.loads(body)["items"]:
                for k, v in cols.items():
                    v.append(item[k])
        return cols

    def rows_from_columns() -> Any:
        cols: dict[str, list[Any]] = {}
        for body in fetched["columns"]:
            page = json.loads(body)
            for k in ("step", "loss", "loss_scale", "finite"):
                cols.setdefault(k, []).extend(page[k])
        return cols

    def rows_from_csv() -> Any:
        return list(csv.reader(io.StringIO(fetched["CSV"].decode())))

    def rows_from_arrow() -> Any:
        import pyarrow as pa

        return pa.ipc.open_stream(fetched["Arrow"]).read_all()

    def rows_from_parquet() -> Any:
        import pyarrow.parquet as pq

        return pq.read_table(io.BytesIO(fetched["Parquet"]))

    return {
        "JSON pages": (
            fetch("JSON pages", lambda: pages(base, {"limit": 10_000}, lambda p: 0)),
            rows_from_pages,
        ),
        "columns": (
            fetch(
                "columns",
                lambda: pages(base, {"format": "columns", "limit": 1_000_000}, lambda p: 0),
            ),
            rows_from_columns,
        ),
        "CSV": (fetch("CSV", lambda: whole(f"{base}.csv")), rows_from_csv),
        "Arrow": (fetch("Arrow", lambda: whole(f"{base}.arrow")), rows_from_arrow),
        "Parquet": (fetch("Parquet", lambda: whole(f"{base}.parquet")), rows_from_parquet),
    }


def fetched_and_decoded(fetch: Callable[[], int], decode: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: (fetch(), decode())


def row(what: str, value: str, note: str = "") -> None:
    print(f"  {what:60s} {value:>16s}  {note}", flush=True)


def bench_ingest(url: str, steps: int, repeat: int) -> None:
    """Only the ingest, ``repeat`` times at each batch size (a fresh job each time)."""
    home = Path(tempfile.mkdtemp())
    try:
        db = fresh_database(url, home)
        db_url = db.engine.url.render_as_string(hide_password=False)
        settings = Settings(home=home, database_url=db_url, lease_seconds=600)
        records = synthetic(steps)
        print(f"database: {db.dialect}; jobs of {steps:,} steps", flush=True)
        for batch in (333, 10_000):
            rates = [ingest(db, settings, records, batch)[0] for _ in range(repeat)]
            each = ", ".join(f"{r:,.0f}" for r in rates)
            row(
                f"ingest, supervisor's flush, batches of {batch:,}",
                f"{statistics.median(rates):,.0f} steps/s",
                f"(median; min {min(rates):,.0f}, max {max(rates):,.0f}: {each})",
            )
        db.dispose()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def bench(url: str, steps: int, repeat: int, points: int) -> None:
    home = Path(tempfile.mkdtemp())
    try:
        db = fresh_database(url, home)
        db_url = db.engine.url.render_as_string(hide_password=False)
        settings = Settings(home=home, database_url=db_url, lease_seconds=600)
        with db.write() as s:
            token = auth.add_user(s, "bench", admin=True)
        records = synthetic(steps)
        print(f"database: {db.dialect}; jobs of {steps:,} steps", flush=True)
        for batch in (333, 10_000):
            rate, job_id = ingest(db, settings, records, batch)
            pg_333 = batch == 333 and db.dialect == "postgresql"
            note = "(target >= 150,000)" if pg_333 else ""
            row(f"ingest, supervisor's flush, batches of {batch:,}", f"{rate:,.0f} steps/s", note)
        # job_id: the 10,000-row job's; both jobs hold the same rows
        if db.dialect == "postgresql":
            with db.engine.connect() as conn:
                conn.execute(text("ANALYZE"))
                sizes = {
                    t: conn.execute(text(f"SELECT pg_total_relation_size('{t}')")).scalar() or 0
                    for t in ("step", "step_rollup", "scale_event")
                }
            per_step = sum(sizes.values()) / (2 * steps)
            row("bytes per step (table, key, rollups, events)", f"{per_step:.1f}")

        hi = steps - 1
        with (
            served(db_url, home) as base,
            httpx.Client(
                base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=600
            ) as http,
        ):
            formats = readers(http, job_id)
            received: dict[str, float] = {}
            for name, (fetch, decode) in formats.items():
                size = fetch()  # warm (and checked once)
                decoded = decode()
                count = (
                    decoded.num_rows
                    if hasattr(decoded, "num_rows")
                    else (len(decoded) - 1 if isinstance(decoded, list) else len(decoded["step"]))
                )
                assert count == steps, (name, count)
                received[name] = timed(fetch, repeat)
                both = timed(fetched_and_decoded(fetch, decode), max(1, repeat // 2))
                ratio = received["JSON pages"] / received[name]
                row(
                    f"whole history as {name} through HTTP (+ decoded)",
                    f"{received[name] * 1000:,.0f} ms",
                    f"(+ decoded {both * 1000:,.0f} ms; {size / steps:.1f} bytes/row; "
                    f"{ratio:.1f}x JSON pages)",
                )

            path, query = f"/v1/jobs/{job_id}/history", {"points": points}

            def buckets() -> None:
                get(http, path, params=query)

            def tail() -> None:
                params = {"after_step": hi - 1000, "limit": 1000}
                r = get(http, f"/v1/jobs/{job_id}/history", params=params)
                assert len(r.json()["items"]) == 1000

            etag = get(http, f"/v1/jobs/{job_id}").headers["etag"]

            def poll() -> None:
                r = get(http, f"/v1/jobs/{job_id}", headers={"If-None-Match": etag})
                assert r.status_code == 304

            for _ in range(STEADY):
                buckets()
            row(
                f"points={points} over the whole job, HTTP",
                f"{timed(buckets, repeat) * 1000:.1f} ms",
            )
            row(
                "1,000-row after_step page at the tail, HTTP",
                f"{timed(tail, repeat) * 1000:.1f} ms",
            )
            row("304 poll of the job, HTTP", f"{timed(poll, repeat * 5) * 1000:.2f} ms")

        # As a dashboard meets them under the production defaults (the poll cache, the lean
        # path): the first read of each snapshot, then the same page again within it.
        with (
            served(db_url, home, CACHE_SECONDS) as base,
            httpx.Client(
                base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=600
            ) as http,
        ):
            first, again = [], []
            for _ in range(STEADY + repeat):
                time.sleep(CACHE_SECONDS * 1.2)  # the snapshot has aged: this read is cold
                first.append(timed(lambda: get(http, path, params=query), 1))
                again.append(timed(lambda: get(http, path, params=query), 1))
            row(
                f"points={points}, first read of a snapshot (poll cache on), HTTP",
                f"{statistics.median(first[STEADY:]) * 1000:.1f} ms",
            )
            row(
                f"points={points}, again within the snapshot, HTTP",
                f"{statistics.median(again[STEADY:]) * 1000:.2f} ms",
            )

        grid = rollups.grid_for(0, hi, points)

        def from_rollups() -> Any:
            with db.read() as s:
                return rollups.buckets(s, job_id, lo=0, hi=hi, points=points)

        def from_rows() -> Any:
            with db.read() as s:
                return rollups._raw_groups(s, job_id, 0, hi, grid)

        a = {b.index: (b.first_step, b.last_step, b.count) for b in from_rollups()}
        b = {k: (g.first_step, g.last_step, g.count) for k, g in from_rows().items()}
        assert a == b, "rollups and rows disagree"
        for _ in range(STEADY):
            from_rollups()
        t_rollups = timed(from_rollups, repeat)
        t_rows = timed(from_rows, max(1, repeat // 3))
        row(f"{len(a)} buckets in SQL: from the rollups", f"{t_rollups * 1000:.1f} ms")
        row(
            f"{len(a)} buckets in SQL: from every step row",
            f"{t_rows * 1000:.1f} ms",
            f"({t_rows / t_rollups:.0f}x the rollups)",
        )
        db.dispose()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--databases",
        default="sqlite",
        help="Comma-separated: 'sqlite' (a temporary file) and/or PostgreSQL URLs (wiped).",
    )
    parser.add_argument("--steps", default="100000,1000000", help="Comma-separated job sizes.")
    parser.add_argument("--points", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=["ingest"], help="Measure only this part.")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} (2-minute: {os.getloadavg()[1]:.2f})")
    for url in args.databases.split(","):
        for steps in (int(s) for s in args.steps.split(",")):
            if args.only == "ingest":
                bench_ingest(url, steps, args.repeat)
            else:
                bench(url, steps, args.repeat, args.points)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    results.run(main)
