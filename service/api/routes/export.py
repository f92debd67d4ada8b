"""Whole runs in columns: ``history?format=columns`` (columnar JSON pages of up to a million
rows), ``history.arrow`` (an Arrow IPC stream) and ``history.parquet``, both streamed in
constant memory. Every row goes from the database into arrays without a Python object of
its own (see ``service.recording.columnar``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from service.api.deps import DbDep, JobId, PrincipalDep
from service.api.etag import etag_of, respond
from service.api.pages import cached_page, polled_page
from service.api.pollcache import PollCache
from service.api.responses import error_responses
from service.database.db import Database
from service.errors import SpecError
from service.recording import columnar, history
from service.recording.columnar import ARROW_MEDIA_TYPE, PARQUET_MEDIA_TYPE
from service.scheduling import jobs

router = APIRouter(tags=["history"])

MAX_STEP = columnar.MAX_STEP
MAX_ROWS_PER_PAGE = 1_000_000
ERRORS = error_responses(401, 404, 422)


# --------------------------------------------------------------------------------------------
# ?format=columns (served by GET /v1/jobs/{id}/history, which hands over here)


async def columns_page(
    request: Request, db: Database, cache: PollCache, job_id: int, after_step: int, limit: int
) -> Response:
    """A page of columns. Like the row pages it is cut at the job's poll snapshot when the
    poll cache is on, so pollers' cursors meet and one query answers all of them; a poll
    already at the snapshot's last step is answered on the event loop without a query."""
    if cached := cached_page(cache, job_id, after_step, limit, "columns"):
        return respond(request, *cached)
    return await run_in_threadpool(_columns_page, request, db, cache, job_id, after_step, limit)


def _columns_page(
    request: Request, db: Database, cache: PollCache, job_id: int, after_step: int, limit: int
) -> Response:
    if cache.ttl <= 0:
        with db.read() as session:
            job = jobs.get_job(session, job_id)  # before the rows, as for row pages
            version = (job.history_version, job.history_reset_step)
            found = columnar.read_columns(session, job_id, after_step=after_step, limit=limit)
            body = columnar.columns_body(job_id, job.status, found, after_step, version)
        return respond(request, body, etag_of(body, version[0]))
    return respond(request, *polled_page(db, cache, job_id, after_step, limit, "columns"))


# --------------------------------------------------------------------------------------------
# Arrow and Parquet files

FromStep = Annotated[
    int | None, Query(ge=0, le=MAX_STEP, description="First step (default: the first recorded).")
]
ToStep = Annotated[
    int | None, Query(ge=0, le=MAX_STEP, description="Last step (default: the last recorded).")
]


def _span(db: Database, job_id: int, from_step: int | None, to_step: int | None) -> range:
    """The steps to export; the job must exist (a 404 before streaming starts)."""
    if from_step is not None and to_step is not None and to_step < from_step:
        raise SpecError("to_step", "range", "must not be below from_step")
    with db.read() as session:
        jobs.get_job(session, job_id)
        recorded = history.step_range(session, job_id)
    if recorded is None:
        return range(0)
    lo = recorded[0] if from_step is None else max(from_step, recorded[0])
    hi = recorded[1] if to_step is None else min(to_step, recorded[1])
    return range(lo, hi + 1)


def _chunks(db: Database, job_id: int, span: range) -> Iterator[columnar.Columns]:
    if len(span):
        yield from columnar.iter_columns(db, job_id, lo=span.start, hi=span.stop - 1)


def _file(
    body: Iterator[bytes], media_type: str, job_id: int, span: range, suffix: str
) -> StreamingResponse:
    name = f"job-{job_id}-history{f'-{span.start}-{span.stop - 1}' if len(span) else ''}"
    return StreamingResponse(
        body,
        media_type=media_type,
        headers={"Content-Disposition": f'attachment; filename="{name}.{suffix}"'},
    )


@router.get(
    "/v1/jobs/{job_id}/history.arrow",
    response_class=StreamingResponse,
    responses={200: {"content": {ARROW_MEDIA_TYPE: {}}}, **ERRORS},
)
def get_history_arrow(
    job_id: JobId, db: DbDep, _: PrincipalDep, from_step: FromStep = None, to_step: ToStep = None
) -> Response:
    """Every row of steps from_step..to_step as an Arrow IPC stream (columns step, epoch,
    loss, loss_scale, finite; NaN and infinite losses as themselves), streamed."""
    span = _span(db, job_id, from_step, to_step)
    body = columnar.arrow_stream(_chunks(db, job_id, span), job_id)
    return _file(body, ARROW_MEDIA_TYPE, job_id, span, "arrow")


@router.get(
    "/v1/jobs/{job_id}/history.parquet",
    response_class=StreamingResponse,
    responses={200: {"content": {PARQUET_MEDIA_TYPE: {}}}, **ERRORS},
)
def get_history_parquet(
    job_id: JobId, db: DbDep, _: PrincipalDep, from_step: FromStep = None, to_step: ToStep = None
) -> Response:
    """The same rows as ``history.arrow``, as a Parquet file (a row group per 131,072 rows),
    streamed."""
    span = _span(db, job_id, from_step, to_step)
    body = columnar.parquet_stream(_chunks(db, job_id, span), job_id)
    return _file(body, PARQUET_MEDIA_TYPE, job_id, span, "parquet")
