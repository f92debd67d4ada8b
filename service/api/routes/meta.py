"""Policies, the caller and health."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from service.api.deps import DbDep, PrincipalDep
from service.api.responses import MeOut, PolicyOut, error_responses
from service.specs.policies import POLICIES
from service.vocabulary import vocabulary

router = APIRouter(tags=["meta"])


@router.get("/v1/policies", response_model=list[PolicyOut], responses=error_responses(401))
def list_policies(_: PrincipalDep) -> list[PolicyOut]:
    return [
        PolicyOut(
            name=p.name,
            variable_dtype=p.variable_dtype,
            compute_dtype=p.compute_dtype,
            loss_scaling_advised=p.loss_scaling_advised,
            note=p.note,
        )
        for p in POLICIES.values()
    ]


@router.get("/v1/me", response_model=MeOut, responses=error_responses(401))
async def get_me(principal: PrincipalDep) -> MeOut:
    """Who the token belongs to: what the dashboard needs to offer only the actions the
    caller may take (cancel and priority: the job's owner, or an admin)."""
    return MeOut.model_validate({"name": principal.name, "role": principal.role})


@router.get("/v1/vocabulary")
async def get_vocabulary() -> dict[str, list[str]]:
    """The words clients share with the server (job statuses, which of them are final, why a
    loss scale changes): public, so the dashboard can read them before it has a token."""
    return vocabulary()


@router.get("/healthz")
def healthz(db: DbDep) -> dict[str, str]:
    with db.engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    return {"status": "ok", "database": db.dialect}
