"""The job list's reload, as the poll cache does it once per cache age while dashboards read
the list: a page of N jobs (the dashboard's 100 by default) of which one, the running job,
changed since the last reload. Prints, side by side in one run for each database, the
median time of

- the page encoded whole (query, a ``JobOut`` per job, JSON), as the list route did before;
- the page from kept items (``PollCache.item``): the list's query with the JSON columns as
  their text, each row's fingerprint, and an encoding for the changed job only;
- that query alone;

and the ratio of the first to the second.

    .venv/bin/python benchmarks/list_items.py
    .venv/bin/python benchmarks/list_items.py --databases sqlite,postgresql://root@127.0.0.1:5432/bench_explain

Each PostgreSQL database named is wiped (its tables dropped and recreated).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select, update

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results
from history import fresh_database, new_job

from service.api import joblist
from service.api.etag import serialize
from service.api.pollcache import ListKey, PollCache
from service.api.responses import JobPage
from service.api.routes.jobs import job_listing, job_out
from service.database.db import Database
from service.database.models import Job


def whole_page(db: Database, limit: int) -> bytes:
    """As the list route read the page before: ORM objects, a ``JobOut`` each, JSON."""
    with db.read() as session:
        rows = list(session.scalars(select(Job).order_by(Job.id.desc()).limit(limit + 1)))
        next_id = rows[limit - 1].id if len(rows) > limit else None
        items = [job_out(j) for j in rows[:limit]]
    return serialize(JobPage(items=items, next_cursor=str(next_id) if next_id else None))


def query_only(db: Database, limit: int) -> None:
    with db.read() as session:
        joblist.list_rows(session, limit=limit)


def bench(url: str, count: int, repeat: int) -> None:
    db = fresh_database(url, Path(tempfile.mkdtemp()))
    ids = [new_job(db) for _ in range(count)]
    running = ids[-1]
    step = 0

    def flush() -> None:  # what the running job's flush changes between two reloads
        nonlocal step
        step += 333
        with db.write() as session:
            session.execute(
                update(Job)
                .where(Job.id == running)
                .values(last_step=step, last_loss=1.0 / step, loss_scale=32768.0)
            )

    cache = PollCache(ttl=3600)
    key: ListKey = (None, None, None, count)

    def kept() -> bytes:
        cache.forget()  # the listing's age ran out; the items stay
        return job_listing(db, cache, key).body

    assert kept() == whole_page(db, count)
    flush()
    assert kept() == whole_page(db, count)
    times: dict[str, list[float]] = {"whole": [], "kept": [], "query": []}

    def sample(name: str, fn: Callable[[], object]) -> None:
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)

    for _ in range(repeat):  # interleaved, so that the machine's drift hits all three
        flush()
        sample("whole", lambda: whole_page(db, count))
        flush()
        sample("kept", kept)
        sample("query", lambda: query_only(db, count))
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"{db.dialect}, {count} jobs, one changed per reload, median of {repeat}:")
    print(f"  encoded whole      {medians['whole'] * 1000:7.2f} ms")
    print(f"  from kept items    {medians['kept'] * 1000:7.2f} ms")
    print(f"  the query alone    {medians['query'] * 1000:7.2f} ms")
    print(f"  whole / kept       {medians['whole'] / medians['kept']:7.2f}x")
    db.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--databases", default="sqlite", help="'sqlite' and/or PostgreSQL URLs.")
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=101)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for url in args.databases.split(","):
        bench(url, args.jobs, args.repeat)


if __name__ == "__main__":
    results.run(main)
