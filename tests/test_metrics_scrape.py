"""What `/metrics` reads from the database: a few aggregate rows however many jobs have run
(a scrape every 15 s must not load every finished job), and counters that only grow, even
when a resumed job's history is cut back to its checkpoint. Both databases."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event

from service.database.db import Database
from service.database.models import Job, utcnow
from service.metrics import DURATION_BUCKETS
from service.recording import history
from service.recording.records import StepRecord
from service.scheduling import jobs
from service.specs.schemas import JobSpec, SubmitResult


def add_finished(db: Database, durations: dict[str, list[float]]) -> None:
    start = utcnow() - timedelta(days=30)
    with db.write() as s:
        for status, seconds in durations.items():
            for d in seconds:
                submitted = SubmitResult(spec=JobSpec(), warnings=[], notes=[])
                job = jobs.create_job(s, owner="alice", submitted=submitted, now=start)
                job.status, job.started_at = status, start
                job.finished_at = start + timedelta(seconds=d)


@contextmanager
def statements(db: Database) -> Iterator[list[tuple[str, Any]]]:
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append((statement, parameters))

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(db.engine, "before_cursor_execute", record)


def rows_read(db: Database, seen: list[tuple[str, Any]]) -> int:
    """The rows the scrape's SELECTs return, by running each again."""
    total = 0
    with db.engine.connect() as conn:
        for statement, parameters in seen:
            if statement.lstrip().upper().startswith("SELECT"):
                total += len(conn.exec_driver_sql(statement, parameters).fetchall())
        conn.rollback()
    return total


def scrape(client: TestClient) -> dict[str, Any]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def test_a_scrape_reads_a_few_rows_however_many_jobs_have_finished(
    db: Database, client: TestClient
) -> None:
    add_finished(db, {"succeeded": [3.0], "failed": [40.0]})
    with statements(db) as few:
        scrape(client)
    add_finished(db, {"succeeded": [2.0 + i for i in range(150)], "cancelled": [7.5] * 50})
    with statements(db) as many:
        metrics = scrape(client)
    assert len(many) == len(few)
    assert rows_read(db, many) == rows_read(db, few) <= 20
    # ...and the histogram it builds from them is exact.
    durations = {
        "succeeded": [3.0] + [2.0 + i for i in range(150)],
        "failed": [40.0],
        "cancelled": [7.5] * 50,
    }
    for status, seconds in durations.items():
        label = f"[('status', '{status}')]"
        assert metrics[f"halfway_job_duration_seconds_count{label}"] == len(seconds)
        assert abs(metrics[f"halfway_job_duration_seconds_sum{label}"] - sum(seconds)) < 1e-3
        for bound in DURATION_BUCKETS:
            le = f"('le', '{float(bound)}')"
            key = f"halfway_job_duration_seconds_bucket[{le}, ('status', '{status}')]"
            assert metrics[key] == sum(1 for d in seconds if d <= bound), (status, bound)


def test_the_step_counters_only_grow_when_a_resume_cuts_history_back(
    db: Database, client: TestClient
) -> None:
    def records(steps: range) -> list[StepRecord]:
        # Every tenth step overflows (and so backs the scale off), the rest are clean.
        out, scale = [], 1024.0
        for s in steps:
            out.append(StepRecord(s, 0, 1.0, scale, s % 10 != 9))
            scale = scale / 2 if s % 10 == 9 else scale
        return out

    with db.write() as s:
        submitted = SubmitResult(spec=JobSpec(), warnings=[], notes=[])
        job_id = jobs.create_job(s, owner="alice", submitted=submitted, now=utcnow()).id
    seen: list[tuple[float, float, float]] = []

    def write(action: Any) -> None:
        with db.write() as s:
            job = s.get(Job, job_id)
            assert job is not None
            action(s, job)
        m = scrape(client)
        seen.append(
            (
                m["halfway_steps_recorded_total[]"],
                m["halfway_overflow_steps_total[]"],
                m["halfway_loss_scale_backoffs_total[]"],
            )
        )

    first = records(range(100))
    write(lambda s, job: history.write_steps(s, job, first, now=utcnow()))
    # The batch sent again after a lost acknowledgement is not counted twice.
    write(lambda s, job: history.write_steps(s, job, first[90:], now=utcnow()))
    # A resumed attempt: history from its checkpoint (step 64) on is replaced, then rewritten
    # (the same steps trained again, and 20 more).
    write(lambda s, job: history.truncate_after(s, job, 64))
    write(lambda s, job: history.write_steps(s, job, records(range(120))[64:], now=utcnow()))
    # 100 steps, 10 overflows, 9 backoffs (the one after step 99 shows at step 100); then
    # steps 64..119 again: 56 steps, 6 overflows, and the backoffs at 70, 80, ..., 110.
    assert seen == [(100, 10, 9), (100, 10, 9), (100, 10, 9), (156, 16, 14)]
