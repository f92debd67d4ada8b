"""History endpoints: raw rows with an ``after_step`` cursor, buckets that keep every spike and
overflow visible, loss-scale events, CSV export, a server-sent event stream, and several jobs
on one bucket grid."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from service.api.deps import (
    ID_PATTERN,
    MAX_ID,
    DbDep,
    JobId,
    PollCacheDep,
    PrincipalDep,
    SessionDep,
)
from service.api.etag import etag_of, etag_response, respond
from service.api.feeds import Feeds, stream
from service.api.pages import bucket_dict, cached_page, page_body, polled_page
from service.api.pollcache import Page, PageKey, PollCache
from service.api.responses import (
    BucketOut,
    BucketPage,
    ColumnsPage,
    ComparedJob,
    Comparison,
    HistoryPage,
    ScaleEventOut,
    ScaleEventPage,
    error_responses,
)
from service.api.routes import export
from service.api.routes.jobs import job_snapshot
from service.database.db import Database
from service.database.models import ScaleEvent
from service.errors import NotFound, SpecError
from service.people.authcache import still_valid
from service.recording import columnar, history, rollups
from service.scheduling import jobs

router = APIRouter(tags=["history"])

MAX_STEP = columnar.MAX_STEP
MAX_POINTS = 5000
MAX_ROWS = 10_000
ERRORS = error_responses(401, 404, 422)
CSV_CHUNK = 10_000
SSE_POLL_SECONDS = 1.0
SSE_KEEPALIVE_SECONDS = 15.0


def bucket_out(b: rollups.Bucket) -> BucketOut:
    return BucketOut(**bucket_dict(b))


# What a bucket page needs of its job, and the first and last step recorded (two index
# probes), in one round trip.
_BUCKET_BASIS = text(
    """
    SELECT status, history_version, history_reset_step,
           (SELECT step FROM step WHERE job_id = :job_id ORDER BY step LIMIT 1),
           (SELECT step FROM step WHERE job_id = :job_id ORDER BY step DESC LIMIT 1)
    FROM job WHERE id = :job_id
    """
)


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
    if points is None and (cached := cached_page(cache, job_id, after_step, limit, "rows")):
        return respond(request, *cached)
    if points is not None and (snap := cache.fresh(job_id)) is not None:
        kept = cache.page(("buckets", job_id, points, from_step, to_step), snap)
        if kept is not None:
            return respond(request, kept.body, kept.etag)
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
        return respond(request, *polled_page(db, cache, job_id, after_step, limit, "rows"))
    if points is not None and cache.ttl > 0:
        page = bucket_page(db, cache, job_id, points, from_step, to_step)
        return respond(request, page.body, page.etag)
    with db.read() as session:
        if points is not None:
            body, version = _buckets(session, job_id, points, from_step, to_step)
            return respond(request, body, etag_of(body, version))
        job = jobs.get_job(session, job_id)  # before the rows: see page_body
        seen = (job.history_version, job.history_reset_step)
        rows, has_more = history.read_steps(session, job_id, after_step=after_step, limit=limit)
        body = page_body(job_id, job.status, rows, after_step, has_more, seen)
        return respond(request, body, etag_of(body, seen[0]))


def bucket_page(
    db: Database,
    cache: PollCache,
    job_id: int,
    points: int,
    from_step: int | None,
    to_step: int | None,
) -> Page:
    """A bucket page, read once per job snapshot for every dashboard that asks for the same
    one: a long run's charts all read their buckets again as the run moves. Blocking."""
    snap = job_snapshot(db, cache, job_id)
    key: PageKey = ("buckets", job_id, points, from_step, to_step)
    with cache.single_flight(key):
        page = cache.page(key, snap)
        if page is None:
            with db.read() as session:
                body, version = _buckets(session, job_id, points, from_step, to_step)
            page = cache.store_page(key, snap, body, version)
    return page


def _buckets(
    session: Session, job_id: int, points: int, from_step: int | None, to_step: int | None
) -> tuple[bytes, int]:
    """A bucket page's body and the history version it was read at."""
    basis = session.execute(_BUCKET_BASIS, {"job_id": job_id}).one_or_none()
    if basis is None:
        raise NotFound(f"job {job_id} does not exist")
    if from_step is not None and to_step is not None and to_step < from_step:
        raise SpecError("to_step", "range", "must not be below from_step")
    status, history_version, reset_step, first, last = basis
    version = (int(history_version), None if reset_step is None else int(reset_step))
    if first is None:  # no steps recorded
        lo, hi = from_step or 0, to_step or 0
    else:
        lo = first if from_step is None else from_step
        hi = last if to_step is None else min(to_step, last)
    grid = rollups.grid_for(lo, max(lo, hi), points)
    found = [] if first is None else rollups.buckets(session, job_id, lo=lo, hi=hi, points=points)
    page = {
        "job_id": job_id,
        "status": status,
        "from_step": lo,
        "to_step": hi,
        "points": points,
        "width": grid.width,
        "origin": grid.origin,
        "buckets": [bucket_dict(b) for b in found],
        "history_version": version[0],
        "history_reset_step": version[1],
    }
    return json.dumps(page, separators=(",", ":"), allow_nan=False).encode(), version[0]


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


# What an EventSource sends back when it reconnects: the id of the last event it got. Empty
# means none (a plain string, not an optional one: OpenAPI has no null header, and a fuzzer
# reading "string or null" sends the text "null").
LAST_EVENT_ID = r"^([0-9]{1,10}:(-1|[0-9]{1,10}))?$"


def resume_point(last_event_id: str) -> tuple[int, int] | None:
    """(history version, last step sent) of a ``Last-Event-ID`` that matched
    ``LAST_EVENT_ID``; None for an empty one."""
    if not last_event_id:
        return None
    seen, step = last_event_id.split(":")
    return int(seen), min(int(step), MAX_STEP)


@router.get(
    "/v1/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **ERRORS},
)
async def stream_events(
    job_id: JobId,
    request: Request,
    db: DbDep,
    _: PrincipalDep,
    after_step: Annotated[int, Query(ge=-1, le=MAX_STEP)] = -1,
    last_event_id: Annotated[
        str,
        Header(
            pattern=LAST_EVENT_ID,
            description="VERSION:STEP, the id of the last event received (an EventSource "
            "sends it when it reconnects); the stream goes on from there, overriding "
            "after_step.",
        ),
    ] = "",
) -> Response:
    """Server-sent events: ``steps`` (new rows, batched), ``status`` (the job, as
    ``GET /v1/jobs/{id}`` answers it, whenever it changes), ``reset`` when a resume rewrote
    history the client already has (``from_step``: drop what you hold from there; the rows
    that replace it follow), and a final ``end`` once the job has finished and every row has
    been sent. Every event's id is ``VERSION:STEP``, the history version and the last step
    sent, so an ``EventSource`` that reconnects (with ``Last-Event-ID``) continues where it
    left off. Listeners of one job share one read per tick (``service.api.feeds``)."""
    # Not a request-scoped session: that would hold a pooled connection for the stream's
    # whole life, and a pool's worth of listeners would leave none for anyone else.
    await run_in_threadpool(_check_job, db, job_id)
    version = None
    resumed = resume_point(last_event_id)
    if resumed is not None:
        version, after_step = resumed
    return StreamingResponse(
        _events(request, job_id, after_step, version),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _check_job(db: Database, job_id: int) -> None:
    with db.read() as session:
        jobs.get_job(session, job_id)  # 404 before the stream starts


def _events(request: Request, job_id: int, after: int, version: int | None) -> AsyncIterator[bytes]:
    feeds: Feeds = request.app.state.feeds
    return stream(
        feeds,
        job_id,
        after,
        version,
        SSE_POLL_SECONDS,
        SSE_KEEPALIVE_SECONDS,
        lambda: still_valid(request),
    )


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
            pattern=f"^{ID_PATTERN}(?:,{ID_PATTERN}){{0,19}}$",
            description="Comma-separated job ids (up to 20), each 1..2147483647.",
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
    grid = rollups.grid_for(lo, hi, points)
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
                history_version=j.history_version,
                buckets=[
                    bucket_out(b)
                    for b in rollups.buckets(session, j.id, lo=lo, hi=hi, points=points)
                ],
            )
            for j in found
        ],
    )
    return etag_response(request, comparison)
