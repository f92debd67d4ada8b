"""Prometheus metrics.

Two kinds: what the database knows (queue depth, running jobs per worker, steps recorded,
overflows, job durations) is read from it at scrape time, so every API replica reports the
same truth whichever process ran the jobs; what only a process knows (its request latency,
its supervisor's history-write latency) lives in that process's registry. A standalone
``halfway worker`` exposes its own with ``--metrics-port``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import Float, Integer, Select, case, cast, func, select
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.database.db import Database
from service.database.models import FINISHED_STATUSES, JOB_STATUSES, Job

REQUEST_LATENCY = Histogram(
    "halfway_http_request_duration_seconds",
    "API request latency.",
    ["method", "route", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
HISTORY_WRITE_LATENCY = Histogram(
    "halfway_history_write_seconds",
    "Time to write one batch of step records (and renew the lease), per transaction.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
EVENT_STREAMS = Gauge(
    "halfway_event_streams",
    "Server-sent event streams this API process is serving now.",
)
DURATION_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 7 * 86400)


class DatabaseCollector(Collector):
    """Job-level facts, read from the database at each scrape (a few small aggregates over
    the job table, never the history)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[Metric]:
        with self.db.read() as s:
            by_status: dict[str, int] = {
                status: n
                for status, n in s.execute(
                    select(Job.status, func.count()).group_by(Job.status)
                ).all()
            }
            running = s.execute(
                select(Job.worker_id, func.count())
                .where(Job.status == "running")
                .group_by(Job.worker_id)
            ).all()
            steps, overflows, backoffs = s.execute(
                select(
                    func.coalesce(func.sum(Job.steps_recorded), 0),
                    func.coalesce(func.sum(Job.overflows_recorded), 0),
                    func.coalesce(func.sum(Job.backoffs_recorded), 0),
                )
            ).one()
            durations = s.execute(_durations_query(self.db.dialect)).all()
        jobs = GaugeMetricFamily("halfway_jobs", "Jobs by status.", labels=["status"])
        for status in JOB_STATUSES:
            jobs.add_metric([status], by_status.get(status, 0))
        yield jobs
        per_worker = GaugeMetricFamily(
            "halfway_running_jobs", "Running jobs per worker.", labels=["worker_id"]
        )
        for worker_id, n in running:
            per_worker.add_metric([worker_id or ""], n)
        yield per_worker
        yield CounterMetricFamily(
            "halfway_steps_recorded",
            "Training steps recorded, all jobs (a step a resumed attempt trains again counts "
            "again).",
            value=int(steps or 0),
        )
        yield CounterMetricFamily(
            "halfway_overflow_steps",
            "Steps whose gradients were not all finite (updates skipped), all jobs.",
            value=int(overflows or 0),
        )
        yield CounterMetricFamily(
            "halfway_loss_scale_backoffs",
            "Times a loss scale backed off after an overflow, all jobs.",
            value=int(backoffs or 0),
        )
        yield _durations(durations)


def _durations_query(dialect: str) -> Select[*tuple[Any, ...]]:
    """One row per finished status: the count, the sum and each bucket's cumulative count,
    aggregated in the database, so a scrape reads a few rows however many jobs have run."""
    if dialect == "sqlite":
        # Whole seconds plus the stored microseconds ("... HH:MM:SS.ffffff"): julianday()'s
        # double of days would put a job of exactly 60 s on either side of the 60 s bucket.
        def epoch(column: Any) -> Any:
            whole = cast(func.strftime("%s", column), Integer)
            return whole + cast(func.substr(column, 20), Float)

        seconds: Any = epoch(Job.finished_at) - epoch(Job.started_at)
    else:
        seconds = func.extract("epoch", Job.finished_at - Job.started_at)
    return (
        select(
            Job.status,
            func.count(),
            func.coalesce(func.sum(seconds), 0.0),
            *(func.sum(case((seconds <= bound, 1), else_=0)) for bound in DURATION_BUCKETS),
        )
        .where(
            Job.status.in_(FINISHED_STATUSES),
            Job.started_at.is_not(None),
            Job.finished_at.is_not(None),
        )
        .group_by(Job.status)
    )


def _durations(rows: Sequence[Any]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "halfway_job_duration_seconds",
        "Wall time from a job's start to its end, by outcome.",
        labels=["status"],
    )
    by_status = {row[0]: row[1:] for row in rows}
    for status in FINISHED_STATUSES:
        count, total, *within = by_status.get(status, (0, 0.0, *(0 for _ in DURATION_BUCKETS)))
        cumulative = [
            (str(float(bound)), int(n or 0))
            for bound, n in zip(DURATION_BUCKETS, within, strict=True)
        ]
        cumulative.append(("+Inf", int(count)))
        family.add_metric([status], cumulative, sum_value=float(total or 0.0))
    return family


class MetricsRegistry:
    """The process registry plus this app's database collector."""

    def __init__(self, db: Database) -> None:
        self.local = CollectorRegistry(auto_describe=False)
        self.local.register(DatabaseCollector(db))

    def render(self) -> bytes:
        return generate_latest(REGISTRY) + generate_latest(self.local)


def metrics_response(registry: MetricsRegistry) -> Response:
    return Response(registry.render(), media_type=CONTENT_TYPE_LATEST)


class ObserveRequests:
    """Request latency by route template (not raw path, so job ids do not explode labels).
    Plain ASGI rather than BaseHTTPMiddleware: that one re-wraps every request and response,
    which costs more than a cached poll itself."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def observe(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            template = getattr(scope.get("route"), "path", "unmatched")
            REQUEST_LATENCY.labels(scope["method"], template, str(status)).observe(
                time.perf_counter() - start
            )
