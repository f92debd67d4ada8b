"""Precision sweeps: one job per variant of a base spec (same model, data and seed), and the
side-by-side comparison a user needs to pick float16, bfloat16 or float32."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from service import jobs, normalization
from service.errors import FieldErrors, NotFound, SpecError
from service.models import FINISHED_STATUSES, Job, Sweep
from service.policies import AUTO, POLICIES, loss_scale_mode_for
from service.responses import SweepOut, VariantResult, json_float
from service.schemas import JobSpec, SweepSpec
from service.settings import Settings


def variant_spec(
    base: dict[str, Any], variant: Any, index: int, target: float | None
) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for section in ("precision", "loss_scale"):
        override = getattr(variant, section)
        if override is not None:
            merged[section] = {**merged.get(section, {}), **override}
    if target is not None:
        merged.setdefault("training", {})["target_loss"] = target
    merged["name"] = variant.name or f"variant-{index}"
    return merged


def create_sweep(
    session: Session, *, owner: str, sweep: SweepSpec, settings: Settings, now: datetime
) -> Sweep:
    """Validate every variant first (a 422 names ``variants.N.field``), then create the sweep
    and its jobs in the caller's transaction, so either all exist or none."""
    try:
        JobSpec.model_validate(sweep.base)
    except ValidationError as exc:
        raise FieldErrors(_fields(exc, "base")) from None
    submitted = []
    problems: list[dict[str, str]] = []
    for i, variant in enumerate(sweep.variants):
        raw = variant_spec(sweep.base, variant, i, sweep.target_loss)
        try:
            submitted.append(normalization.normalize(JobSpec.model_validate(raw), settings))
        except ValidationError as exc:
            problems += _fields(exc, f"variants.{i}")
        except SpecError as exc:
            problems.append(
                {"field": f"variants.{i}.{exc.field}", "rule": exc.rule, "message": exc.detail}
            )
    if problems:
        raise FieldErrors(problems)
    name = sweep.name or "sweep"
    row = Sweep(
        owner=owner,
        name=name,
        base_spec=sweep.base,
        variants=[v.model_dump() for v in sweep.variants],
        target_loss=sweep.target_loss,
        created_at=now,
    )
    session.add(row)
    session.flush()
    for result in submitted:
        result.spec.name = f"{name}/{result.spec.name}"
        jobs.create_job(session, owner=owner, submitted=result, now=now, sweep_id=row.id)
    return row


def trained_as(job: Job) -> tuple[str, str]:
    """The policy and loss-scale mode a job trained with: for policy 'auto', its recorded
    choice (until it has chosen, 'auto' itself)."""
    policy: str = job.spec["precision"]["policy"]
    mode: str = job.spec["loss_scale"]["mode"]
    if policy == AUTO and job.precision_decision:
        policy = job.precision_decision["policy"]
        mode = loss_scale_mode_for(mode, POLICIES[policy].compute_dtype)
    return policy, mode


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
            if trained_as(j)[0] == "float32" and j.status == "succeeded"
        ),
        None,
    )
    variants = []
    for j in rows:
        timing = _timing(j)
        last_epoch = dict(j.metrics.get("last_epoch", {}))
        last_epoch.pop("epoch", None)
        step_s = timing.get("median_step_seconds")
        policy, mode = trained_as(j)
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


def _fields(exc: ValidationError, prefix: str) -> list[dict[str, str]]:
    out = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        out.append(
            {
                "field": f"{prefix}.{path}" if path else prefix,
                "rule": err["type"],
                "message": err["msg"],
            }
        )
    return out


def _timing(job: Job) -> dict[str, float]:
    timing: dict[str, float] = job.metrics.get("timing", {})
    return timing
