"""Precision sweeps: ``POST /v1/sweeps`` creates one job per variant; ``GET /v1/sweeps/{id}``
compares them side by side."""

from __future__ import annotations

from fastapi import APIRouter

from service import grants, sweeps
from service.deps import (
    PollCacheDep,
    PrincipalDep,
    SessionDep,
    SettingsDep,
    SweepId,
    WriteSessionDep,
)
from service.models import utcnow
from service.responses import SweepOut, error_responses
from service.schemas import SweepSpec

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])


@router.post(
    "",
    status_code=201,
    response_model=SweepOut,
    responses=error_responses(401, 403, 413, 422),
)
def create_sweep(
    spec: SweepSpec,
    session: WriteSessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    cache: PollCacheDep,
) -> SweepOut:
    if spec.base.get("code") is not None:
        grants.require_code_right(session, principal, settings.code_jobs)
    row = sweeps.create_sweep(
        session, owner=principal.name, sweep=spec, settings=settings, now=utcnow()
    )
    session.commit()
    cache.forget()  # the lists now hold its jobs
    return sweeps.compare(session, row.id)


@router.get(
    "/{sweep_id}",
    response_model=SweepOut,
    responses=error_responses(401, 404, 422),
)
def get_sweep(sweep_id: SweepId, session: SessionDep, _: PrincipalDep) -> SweepOut:
    return sweeps.compare(session, sweep_id)
