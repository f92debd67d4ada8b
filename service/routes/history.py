"""History endpoints: raw step rows with an ``after_step`` cursor for polling."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from service import history, jobs
from service.deps import PrincipalDep, SessionDep
from service.etag import etag_response
from service.schemas import ErrorOut, HistoryPage, StepOut, json_float, loss_flag

router = APIRouter(prefix="/v1/jobs", tags=["history"])


@router.get(
    "/{job_id}/history",
    response_model=HistoryPage,
    responses={
        304: {"description": "Not modified (If-None-Match)"},
        401: {"model": ErrorOut},
        404: {"model": ErrorOut},
        422: {"model": ErrorOut},
    },
)
def get_history(
    job_id: int,
    request: Request,
    session: SessionDep,
    _: PrincipalDep,
    after_step: Annotated[
        int, Query(ge=-1, le=2**31 - 1, description="Only rows with step > after_step.")
    ] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Response:
    job = jobs.get_job(session, job_id)
    rows, has_more = history.read_steps(session, job_id, after_step=after_step, limit=limit)
    page = HistoryPage(
        job_id=job_id,
        status=job.status,
        items=[
            StepOut(
                step=r.step,
                epoch=r.epoch,
                loss=json_float(r.loss),
                loss_nonfinite=loss_flag(r.loss),
                loss_scale=r.loss_scale,
                finite=r.finite,
            )
            for r in rows
        ],
        next_after_step=rows[-1].step if rows else after_step,
        has_more=has_more,
    )
    return etag_response(request, page)
