"""Precision sweeps: ``POST /v1/sweeps`` creates one job per variant; ``GET /v1/sweeps/{id}``
compares them side by side (built here from the jobs' summaries)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api.deps import (
    PollCacheDep,
    PrincipalDep,
    SessionDep,
    SettingsDep,
    SweepId,
    WriteSessionDep,
)
from service.api.responses import SweepOut, VariantResult, error_responses, json_float
from service.database.models import FINISHED_STATUSES, Job, Sweep, utcnow
from service.errors import NotFound
from service.people import grants
from service.scheduling import sweeps
from service.specs.schemas import SweepSpec

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
    return compare(session, row.id)


@router.get(
    "/{sweep_id}",
    response_model=SweepOut,
    responses=error_responses(401, 404, 422),
)
def get_sweep(sweep_id: SweepId, session: SessionDep, _: PrincipalDep) -> SweepOut:
    return compare(session, sweep_id)


def _shadow_figures(job: Job) -> dict[str, float | None]:
    shadow = (job.gradients_summary or {}).get("latest_shadow") or {}
    return {key: shadow.get(key) for key in ("underflow_share", "lost_share")}


def compare(session: Session, sweep_id: int) -> SweepOut:
    sweep = session.get(Sweep, sweep_id)
    if sweep is None:
        raise NotFound(f"sweep {sweep_id} does not exist")
    rows = list(session.scalars(select(Job).where(Job.sweep_id == sweep_id).order_by(Job.id)))
    float32_step = next(
        (
            _timing(j).get("median_step_seconds")
            for j in rows
            if sweeps.trained_as(j)[0] == "float32" and j.status == "succeeded"
        ),
        None,
    )
    variants = []
    for j in rows:
        timing = _timing(j)
        last_epoch = dict(j.metrics.get("last_epoch", {}))
        last_epoch.pop("epoch", None)
        step_s = timing.get("median_step_seconds")
        policy, mode = sweeps.trained_as(j)
        scaled = mode in ("dynamic", "fixed")
        variants.append(
            VariantResult(
                job_id=j.id,
                name=j.name,
                status=j.status,
                error=j.error,
                policy=policy,
                loss_scale_mode=mode,
                examples_per_second=timing.get("examples_per_second"),
                median_step_seconds=step_s,
                speedup_vs_float32=(float32_step / step_s) if float32_step and step_s else None,
                time_to_target_seconds=timing.get("time_to_target_seconds"),
                step_to_target=(
                    int(timing["step_to_target"]) if "step_to_target" in timing else None
                ),
                final_loss=json_float(last_epoch.get("loss")),
                final_metrics={k: float(v) for k, v in last_epoch.items()},
                overflow_count=j.overflow_count,
                skipped_steps=j.overflow_count if scaled else 0,
                final_loss_scale=j.loss_scale,
                min_loss_scale=j.min_loss_scale,
                peak_memory_bytes=timing.get("peak_memory_bytes"),
                **_shadow_figures(j),
            )
        )
    return SweepOut(
        id=sweep.id,
        name=sweep.name,
        owner=sweep.owner,
        created_at=sweep.created_at,
        target_loss=sweep.target_loss,
        done=all(j.status in FINISHED_STATUSES for j in rows),
        variants=variants,
    )


def _timing(job: Job) -> dict[str, float]:
    timing: dict[str, float] = job.metrics.get("timing", {})
    return timing
