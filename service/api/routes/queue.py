"""The queue in claim order, and users' fair shares (docs/scheduling.md).

``GET /v1/queue``: every queued job in the order the claims take them, with its position, why
it waits, and its owner's recent use, weight and standing. ``GET /v1/users/shares`` (admins):
every user's weight, share, recent use and use in the budget window.
``PUT /v1/users/{name}/share`` (admins): set a user's weight. ``install`` registers the
routes and gives the job answers the app's rule.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, FastAPI, Path
from pydantic import Field

from service.api.deps import PrincipalDep, SessionDep, SettingsDep, WriteSessionDep
from service.api.responses import QueueItem, QueueOut, ShareOut, SharesOut, error_responses
from service.api.routes.jobs import use_rule
from service.errors import Forbidden
from service.people.auth import Principal
from service.scheduling import fairshare
from service.settings import Settings
from service.specs.schemas import StrictModel

router = APIRouter(tags=["queue"])

UserName = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[^\x00]+$")]


def rule(settings: Settings) -> fairshare.Rule:
    return fairshare.Rule.from_settings(settings)


def install(app: FastAPI, settings: Settings) -> None:
    """Add the routes, and compute every job answer's place with this app's rule."""
    use_rule(app.state.poll_cache, rule(settings))
    app.include_router(router)


def _require_admin(principal: Principal, action: str) -> None:
    if not principal.is_admin:
        raise Forbidden(f"only an admin may {action}")


@router.get("/v1/queue", response_model=QueueOut, responses=error_responses(401))
def get_queue(session: SessionDep, settings: SettingsDep, _: PrincipalDep) -> QueueOut:
    """Queued jobs in claim order: position 1 is the next a worker takes."""
    places = [p for p in fairshare.queue(session, rule(settings)) if p.status == "queued"]
    return QueueOut(
        items=[
            QueueItem(
                job_id=p.job_id,
                name=p.name,
                owner=p.owner,
                priority=p.priority,
                created_at=p.created_at,
                position=p.position,
                ahead=p.ahead,
                reason=p.reason,
                owner_usage_seconds=p.usage,
                owner_weight=p.weight,
                owner_standing=p.usage / p.weight,
            )
            for p in places
        ],
        half_life_seconds=settings.fairshare_half_life,
    )


@router.get("/v1/users/shares", response_model=SharesOut, responses=error_responses(401, 403))
def get_shares(session: SessionDep, settings: SettingsDep, principal: PrincipalDep) -> SharesOut:
    """Every user's weight, share and recent use, the next to be served first (admins)."""
    _require_admin(principal, "read every user's share")
    fair = rule(settings)
    return SharesOut(
        items=[
            ShareOut(
                owner=s.owner,
                weight=s.weight,
                share=s.share,
                usage_seconds=s.usage,
                usage_share=s.usage_share,
                standing=s.standing,
                running=s.running,
                window_spent_seconds=s.spent,
            )
            for s in fairshare.shares(session, fair)
        ],
        half_life_seconds=fair.half_life,
        budget_seconds=fair.budget_seconds if fair.has_budget else None,
        window_seconds=fair.window_seconds,
    )


class ShareIn(StrictModel):
    weight: float = Field(gt=0, le=1e6, description="Relative share; 1 by default.")


@router.put(
    "/v1/users/{name}/share",
    response_model=SharesOut,
    responses=error_responses(401, 403, 404, 422),
)
def put_share(
    name: UserName,
    body: ShareIn,
    session: WriteSessionDep,
    settings: SettingsDep,
    principal: PrincipalDep,
) -> SharesOut:
    """Set a user's weight: twice the weight, twice the share of the slots (admins)."""
    _require_admin(principal, "set a user's share")
    fairshare.set_weight(session, name, body.weight)
    session.commit()
    return get_shares(session, settings, principal)
