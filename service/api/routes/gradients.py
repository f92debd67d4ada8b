"""Gradient samples: ``GET /v1/jobs/{id}/gradients``, the sampled steps in step order with an
``after_step`` cursor, as JSON pages (each sample with its variables), model-level columns,
or the long table (one row per step and variable) as Arrow or Parquet."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api.deps import DbDep, JobId, PrincipalDep
from service.api.etag import etag_of, respond
from service.api.responses import GradientColumnsPage, GradientsPage, error_responses
from service.database.models import Job
from service.errors import NotFound, SpecError
from service.recording import gradients
from service.recording.columnar import ARROW_MEDIA_TYPE, MAX_STEP, PARQUET_MEDIA_TYPE

router = APIRouter(tags=["gradients"])

DEFAULT_LIMIT = 200
MAX_JSON_SAMPLES = 1000  # a page of samples with their variables: up to ~100 KB each
MAX_COLUMN_SAMPLES = 100_000  # model level only: a few MB of JSON
MAX_SAMPLES = 1_000_000  # Arrow and Parquet: streamed in chunks, each its own query
ERRORS = error_responses(401, 404, 422)

Format = Literal["json", "columns", "arrow", "parquet"]


@router.get(
    "/v1/jobs/{job_id}/gradients",
    response_model=GradientsPage | GradientColumnsPage,
    responses={
        200: {"content": {ARROW_MEDIA_TYPE: {}, PARQUET_MEDIA_TYPE: {}}},
        304: {"description": "Not modified (If-None-Match)"},
        **ERRORS,
    },
)
def get_gradients(
    job_id: JobId,
    request: Request,
    db: DbDep,
    _: PrincipalDep,
    after_step: Annotated[
        int, Query(ge=-1, le=MAX_STEP, description="Only samples of steps > after_step.")
    ] = -1,
    limit: Annotated[
        int | None,
        Query(
            ge=1,
            le=MAX_SAMPLES,
            description=f"Samples at most: default {DEFAULT_LIMIT} and up to "
            f"{MAX_JSON_SAMPLES} with format=json, up to {MAX_COLUMN_SAMPLES} (default) "
            "with columns; arrow and parquet stream every sample by default.",
        ),
    ] = None,
    format: Annotated[
        Format,
        Query(
            description="json: samples with their variables; columns: model-level figures, "
            "one array per field; arrow / parquet: the long table, one row per step and "
            'variable (the whole model\'s row has variable "(model)").'
        ),
    ] = "json",
) -> Response:
    """The job's gradient samples in step order. A resume that cuts samples moves
    ``history_version`` on, as it does for the step history: start over from the cut."""
    if format in ("arrow", "parquet"):
        with db.read() as session:
            _version(session, job_id)  # a 404 before streaming starts
        chunks = gradients.iter_samples(db, job_id, after_step=after_step, limit=limit)
        body = gradients.long_table_stream(chunks, job_id, format)
        media_type = ARROW_MEDIA_TYPE if format == "arrow" else PARQUET_MEDIA_TYPE
        name = f"job-{job_id}-gradients.{format}"
        return StreamingResponse(
            body,
            media_type=media_type,
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )
    most = MAX_JSON_SAMPLES if format == "json" else MAX_COLUMN_SAMPLES
    if limit is not None and limit > most:
        raise SpecError("query.limit", "range", f"at most {most} samples with format={format}")
    with db.read() as session:
        # The version before the samples: a page never claims a newer one than its rows.
        version = _version(session, job_id)
        found, has_more = gradients.read_samples(
            session,
            job_id,
            after_step=after_step,
            limit=limit or (DEFAULT_LIMIT if format == "json" else most),
            variables=format == "json",
        )
    build = gradients.samples_body if format == "json" else gradients.columns_body
    page = build(job_id, version, found, has_more)
    return respond(request, page, etag_of(page, version))


def _version(session: Session, job_id: int) -> int:
    """The job's history version; NotFound (404) if there is no such job."""
    version = session.scalar(select(Job.history_version).where(Job.id == job_id))
    if version is None:
        raise NotFound(f"job {job_id} does not exist")
    return version
