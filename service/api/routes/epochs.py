"""Per-epoch metrics: ``GET /v1/jobs/{id}/metrics``, what Keras reported at the end of each
epoch (loss, accuracy, their validation twins, the user's own metrics), in epoch order. A few
rows per job, read whole; the dashboard's metric charts ask again only when the job's epoch
moves, and a repeated ask with If-None-Match is a 304."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field
from sqlalchemy import select

from service.api.deps import DbDep, JobId, PrincipalDep
from service.api.etag import etag_of, respond, serialize
from service.api.responses import error_responses
from service.database.models import Job
from service.errors import NotFound
from service.recording import epochmetrics

router = APIRouter(tags=["history"])


class EpochOut(BaseModel):
    epoch: int = Field(description="0-based, as Keras counts (the step record's epoch).")
    metrics: dict[str, float | None] = Field(
        description="Name to value, as Keras' logs name them (loss, accuracy, val_loss, ...); "
        "null where the value was NaN or infinite."
    )


class EpochMetricsPage(BaseModel):
    job_id: int
    epochs: list[EpochOut] = Field(
        description="Every epoch that has ended, in order. A resume drops the epochs from "
        "the one it restarts in, which it reports again."
    )


@router.get(
    "/v1/jobs/{job_id}/metrics",
    response_model=EpochMetricsPage,
    responses={304: {"description": "Not modified (If-None-Match)"}, **error_responses(401, 404)},
)
def get_epoch_metrics(job_id: JobId, request: Request, db: DbDep, _: PrincipalDep) -> Response:
    """Each ended epoch's metrics, in epoch order."""
    with db.read() as session:
        if session.scalar(select(Job.id).where(Job.id == job_id)) is None:
            raise NotFound(f"job {job_id} does not exist")
        epochs = epochmetrics.read_epochs(session, job_id)
    body = serialize(
        EpochMetricsPage(job_id=job_id, epochs=[EpochOut.model_validate(e) for e in epochs])
    )
    return respond(request, body, etag_of(body))
