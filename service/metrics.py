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
from sqlalchemy import func, select
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.db import Database
from service.models import FINISHED_STATUSES, JOB_STATUSES, Job

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
                    func.coalesce(func.sum(Job.last_step + 1), 0),
                    func.coalesce(func.sum(Job.overflow_count), 0),
                    func.coalesce(func.sum(Job.backoff_count), 0),
                )
            ).one()
            spans = s.execute(
                select(Job.status, Job.started_at, Job.finished_at).where(
                    Job.status.in_(FINISHED_STATUSES),
                    Job.started_at.is_not(None),
                    Job.finished_at.is_not(None),
                )
            ).all()
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
            "halfway_steps_recorded", "Training steps recorded, all jobs.", value=int(steps or 0)
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
        yield _durations(spans)


def _durations(spans: Sequence[Any]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "halfway_job_duration_seconds",
        "Wall time from a job's start to its end, by outcome.",
        labels=["status"],
    )
    for status in FINISHED_STATUSES:
        seconds = [(end - start).total_seconds() for st, start, end in spans if st == status]
        cumulative = []
        for bound in DURATION_BUCKETS:
            cumulative.append((str(float(bound)), sum(1 for d in seconds if d <= bound)))
        cumulative.append(("+Inf", len(seconds)))
        family.add_metric([status], cumulative, sum_value=sum(seconds))
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
