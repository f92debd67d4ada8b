"""History endpoints: raw rows with an ``after_step`` cursor, buckets that keep every spike and
overflow visible, loss-scale events, CSV export, a server-sent event stream, and several jobs
on one bucket grid."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from service import history, jobs
from service.db import Database
from service.deps import MAX_ID, DbDep, JobId, PollCacheDep, PrincipalDep, SessionDep
from service.errors import SpecError
from service.etag import etag_of, etag_response, respond
from service.models import FINISHED_STATUSES, ScaleEvent
from service.pollcache import PollCache
from service.routes import export
from service.routes.jobs import job_out, job_snapshot
from service.schemas import (
    BucketOut,
    BucketPage,
    ColumnsPage,
    ComparedJob,
    Comparison,
    HistoryPage,
    ScaleEventOut,
    ScaleEventPage,
    error_responses,
    json_float,
    loss_flag,
)

router = APIRouter(tags=["history"])

MAX_STEP = 2**31 - 1
MAX_POINTS = 5000
MAX_ROWS = 10_000
ERRORS = error_responses(401, 404, 422)
CSV_CHUNK = 10_000
SSE_POLL_SECONDS = 1.0
SSE_KEEPALIVE_SECONDS = 15.0


def step_dict(r: history.StepRow) -> dict[str, Any]:
    """A StepOut as a plain dict: pages hold up to ten thousand, and a pydantic object per row
    would cost several times the query. The tests validate pages against StepOut's schema."""
    return {
        "step": r.step,
        "epoch": r.epoch,
        "loss": json_float(r.loss),
        "loss_nonfinite": loss_flag(r.loss),
        "loss_scale": r.loss_scale,
        "finite": r.finite,
    }


def page_body(
    job_id: int, status: str, rows: list[history.StepRow], after_step: int, has_more: bool
) -> bytes:
    """A HistoryPage as JSON (``tests/test_api_jobs.py`` checks it against the schema)."""
    page = {
        "job_id": job_id,
        "status": status,
        "items": [step_dict(r) for r in rows],
        "next_after_step": rows[-1].step if rows else after_step,
        "has_more": has_more,
    }
    return json.dumps(page, separators=(",", ":"), allow_nan=False).encode()


def bucket_dict(b: history.Bucket) -> dict[str, Any]:
    """A BucketOut as a plain dict (a page holds thousands; see page_body)."""
    return {
        "index": b.index,
        "first_step": b.first_step,
        "last_step": b.last_step,
        "count": b.count,
        "loss_min": b.loss_min,
        "loss_max": b.loss_max,
        "loss_last": json_float(b.loss_last),
        "loss_last_nonfinite": loss_flag(b.loss_last),
        "scale_min": b.scale_min,
        "scale_max": b.scale_max,
        "scale_last": b.scale_last,
        "overflow_count": b.overflow_count,
        "nonfinite_loss_count": b.nonfinite_loss_count,
    }


def bucket_out(b: history.Bucket) -> BucketOut:
    return BucketOut(**bucket_dict(b))


def _range(
    session: Any, job_id: int, from_step: int | None, to_step: int | None
) -> tuple[int, int] | None:
    if from_step is not None and to_step is not None and to_step < from_step:
        raise SpecError("to_step", "range", "must not be below from_step")
    recorded = history.step_range(session, job_id)
    if recorded is None:
        return None
    lo = recorded[0] if from_step is None else from_step
    hi = recorded[1] if to_step is None else min(to_step, recorded[1])
    return lo, hi


@router.get(
    "/v1/jobs/{job_id}/history",
    response_model=HistoryPage | ColumnsPage | BucketPage,
    responses={304: {"description": "Not modified (If-None-Match)"}, **ERRORS},
)
async def get_history(
    job_id: JobId,
    request: Request,
    db: DbDep,
    cache: PollCacheDep,
    _: PrincipalDep,
    after_step: Annotated[
        int, Query(ge=-1, le=MAX_STEP, description="Raw rows: only steps > after_step.")
    ] = -1,
    limit: Annotated[
        int,
        Query(
            ge=1,
            le=export.MAX_ROWS_PER_PAGE,
            description="Raw rows per page: up to 10,000, or 1,000,000 with format=columns.",
        ),
    ] = 1000,
    points: Annotated[
        int | None,
        Query(ge=1, le=MAX_POINTS, description="Return at most this many buckets instead of rows."),
    ] = None,
    from_step: Annotated[int | None, Query(ge=0, le=MAX_STEP, description="Buckets: zoom.")] = None,
    to_step: Annotated[int | None, Query(ge=0, le=MAX_STEP, description="Buckets: zoom.")] = None,
    format: Annotated[
        Literal["rows", "columns"],
        Query(description="Raw rows as a list of objects, or as one array per field."),
    ] = "rows",
) -> Response:
    if format == "columns" and points is None:
        return await export.columns_page(request, db, cache, job_id, after_step, limit)
    if points is None and limit > MAX_ROWS:
        raise SpecError(
            "query.limit", "range", f"at most {MAX_ROWS} rows a page without format=columns"
        )
    # Async so that the common poll, one that already has every row as of the job's snapshot,
    # is answered on the event loop without a thread hop or a query.
    snap = cache.fresh(job_id)
    if points is None and snap is not None:
        if snap.last_step is None or after_step >= snap.last_step:
            body = page_body(job_id, snap.status, [], after_step, False)
            return respond(request, body, etag_of(body))
        page = cache.page(job_id, after_step, limit, snap)
        if page is not None:
            return respond(request, page.body, page.etag)
    return await run_in_threadpool(
        _history, request, db, cache, job_id, after_step, limit, points, from_step, to_step
    )


def _history(
    request: Request,
    db: Database,
    cache: PollCache,
    job_id: int,
    after_step: int,
    limit: int,
    points: int | None,
    from_step: int | None,
    to_step: int | None,
) -> Response:
    if points is None and cache.ttl > 0:
        return _polled_rows(request, db, cache, job_id, after_step, limit)
    with db.read() as session:
        return _history_in(request, session, job_id, after_step, limit, points, from_step, to_step)


def _polled_rows(
    request: Request, db: Database, cache: PollCache, job_id: int, after_step: int, limit: int
) -> Response:
    """New rows for a poller, cut at the job's snapshot so that pollers' cursors meet and one
    query (one at a time, by single flight) answers all of those at the same step."""

    snap = job_snapshot(db, cache, job_id)
    with cache.single_flight(("page", job_id, after_step, limit)):
        page = cache.page(job_id, after_step, limit, snap)
        if page is None:
            with db.read() as session:
                rows, has_more = history.read_steps(
                    session, job_id, after_step=after_step, limit=limit, up_to=snap.last_step
                )
            body = page_body(job_id, snap.status, rows, after_step, has_more)
            page = cache.store_page(job_id, after_step, limit, snap, body)
    return respond(request, page.body, page.etag)


def _history_in(
    request: Request,
    session: Session,
    job_id: int,
    after_step: int,
    limit: int,
    points: int | None,
    from_step: int | None,
    to_step: int | None,
) -> Response:
    job = jobs.get_job(session, job_id)
    if points is None:
        rows, has_more = history.read_steps(session, job_id, after_step=after_step, limit=limit)
        body = page_body(job_id, job.status, rows, after_step, has_more)
        return respond(request, body, etag_of(body))
    span = _range(session, job_id, from_step, to_step)
    lo, hi = span if span is not None else (from_step or 0, to_step or 0)
    grid = history.grid_for(lo, max(lo, hi), points)
    found = history.buckets(session, job_id, lo=lo, hi=hi, points=points) if span else []
    page = {
        "job_id": job_id,
        "status": job.status,
        "from_step": lo,
        "to_step": hi,
        "points": points,
        "width": grid.width,
        "origin": grid.origin,
        "buckets": [bucket_dict(b) for b in found],
    }
    body = json.dumps(page, separators=(",", ":"), allow_nan=False).encode()
    return respond(request, body, etag_of(body))


@router.get(
    "/v1/jobs/{job_id}/loss-scale/events",
    response_model=ScaleEventPage,
    responses={304: {"description": "Not modified (If-None-Match)"}, **ERRORS},
)
def get_scale_events(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    _: PrincipalDep,
    after_step: Annotated[int, Query(ge=-1, le=MAX_STEP)] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Response:
    job = jobs.get_job(session, job_id)
    rows = list(
        session.scalars(
            select(ScaleEvent)
            .where(ScaleEvent.job_id == job_id, ScaleEvent.step > after_step)
            .order_by(ScaleEvent.step)
            .limit(limit + 1)
        )
    )
    has_more = len(rows) > limit
    rows = rows[:limit]
    page = ScaleEventPage(
        job_id=job_id,
        items=[
            ScaleEventOut(
                step=e.step,
                old_scale=e.old_scale,
                new_scale=e.new_scale,
                reason=e.reason,
            )
            for e in rows
        ],
        next_after_step=rows[-1].step if rows else after_step,
        has_more=has_more,
        overflow_events=job.backoff_count,
        growth_events=job.growth_count,
    )
    return etag_response(request, page)


@router.get(
    "/v1/jobs/{job_id}/history.csv",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/csv": {}}}, **ERRORS},
)
def get_history_csv(job_id: JobId, session: SessionDep, db: DbDep, _: PrincipalDep) -> Response:
    jobs.get_job(session, job_id)  # 404 before streaming starts
    return StreamingResponse(
        _csv_rows(db, job_id),
        media_type="text/csv",
        headers={"Content-Disposition": f'attachment; filename="job-{job_id}-history.csv"'},
    )


def _csv_rows(db: Database, job_id: int) -> Iterator[str]:
    """Page through the history by cursor, one short transaction per chunk: constant memory
    however long the job, and no read transaction held open while the client downloads."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["step", "epoch", "loss", "loss_scale", "finite"])
    yield buffer.getvalue()
    after = -1
    while True:
        with db.read() as session:
            rows, has_more = history.read_steps(session, job_id, after_step=after, limit=CSV_CHUNK)
            chunk = [(r.step, r.epoch, r.loss, r.loss_scale, r.finite) for r in rows]
        buffer.seek(0)
        buffer.truncate()
        for step, epoch, loss, scale, finite in chunk:
            # CSV readers (Python, pandas) parse nan/inf/-inf as floats.
            writer.writerow([step, epoch, repr(loss), repr(scale), "true" if finite else "false"])
        if chunk:
            yield buffer.getvalue()
            after = chunk[-1][0]
        if not has_more:
            return


@router.get(
    "/v1/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **ERRORS},
)
def stream_events(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    db: DbDep,
    _: PrincipalDep,
    after_step: Annotated[int, Query(ge=-1, le=MAX_STEP)] = -1,
) -> Response:
    """Server-sent events: ``steps`` (new rows, batched), ``status`` (the job's status and
    summary when they change) and a final ``end`` once the job has finished and every row has
    been sent."""
    jobs.get_job(session, job_id)
    return StreamingResponse(
        _events(request, db, job_id, after_step),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _poll(
    db: Database, job_id: int, after: int
) -> tuple[list[dict[str, Any]], bool, dict[str, Any]]:
    with db.read() as session:
        out = job_out(jobs.get_job(session, job_id))
        rows, has_more = history.read_steps(session, job_id, after_step=after, limit=5000)
        status = {
            "status": out.status,
            "error": out.error,
            "progress": out.progress.model_dump(),
            "summary": out.summary.model_dump(mode="json"),
        }
        return [step_dict(r) for r in rows], has_more, status


async def _events(request: Request, db: Database, job_id: int, after: int) -> AsyncIterator[str]:
    last_status: dict[str, Any] | None = None
    quiet_since = asyncio.get_running_loop().time()
    while not await request.is_disconnected():
        rows, has_more, status = await run_in_threadpool(_poll, db, job_id, after)
        now = asyncio.get_running_loop().time()
        if rows:
            after = rows[-1]["step"]
            yield _sse("steps", {"after_step": after, "items": rows})
            quiet_since = now
        if status != last_status:
            last_status = status
            yield _sse("status", status)
            quiet_since = now
        if status["status"] in FINISHED_STATUSES and not has_more and not rows:
            yield _sse("end", {"status": status["status"], "last_step": after})
            return
        if has_more:
            continue
        if now - quiet_since > SSE_KEEPALIVE_SECONDS:
            yield ": keepalive\n\n"
            quiet_since = now
        await asyncio.sleep(SSE_POLL_SECONDS)


@router.get(
    "/v1/history",
    response_model=Comparison,
    responses={304: {"description": "Not modified (If-None-Match)"}, **ERRORS},
)
def compare_history(
    request: Request,
    session: SessionDep,
    _: PrincipalDep,
    job_ids: Annotated[
        str,
        Query(
            pattern=r"^[0-9]{1,10}(,[0-9]{1,10}){0,19}$",
            description="Comma-separated job ids (up to 20).",
        ),
    ],
    points: Annotated[int, Query(ge=1, le=MAX_POINTS)] = 500,
    from_step: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(ge=0, le=MAX_STEP)] = None,
) -> Response:
    """Several jobs on one bucket grid, aligned by step, for overlaying runs."""
    ids = list(dict.fromkeys(int(i) for i in job_ids.split(",")))
    if not all(1 <= i <= MAX_ID for i in ids):
        raise SpecError("job_ids", "range", f"job ids lie between 1 and {MAX_ID}")
    found = [jobs.get_job(session, i) for i in ids]
    ranges = [r for r in (history.step_range(session, j.id) for j in found) if r is not None]
    if from_step is not None and to_step is not None and to_step < from_step:
        raise SpecError("to_step", "range", "must not be below from_step")
    lo = from_step if from_step is not None else min((r[0] for r in ranges), default=0)
    hi = to_step if to_step is not None else max((r[1] for r in ranges), default=lo)
    hi = max(lo, hi)
    grid = history.grid_for(lo, hi, points)
    comparison = Comparison(
        from_step=lo,
        to_step=hi,
        points=points,
        width=grid.width,
        origin=grid.origin,
        jobs=[
            ComparedJob(
                job_id=j.id,
                name=j.name,
                status=j.status,
                policy=str(j.spec.get("precision", {}).get("policy")),
                buckets=[
                    bucket_out(b)
                    for b in history.buckets(session, j.id, lo=lo, hi=hi, points=points)
                ],
            )
            for j in found
        ],
    )
    return etag_response(request, comparison)
