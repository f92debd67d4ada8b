"""Precision sweeps: one job per variant of a base spec (same model, data and seed). The
side-by-side comparison a user reads to pick float16, bfloat16 or float32 is the API's
(service/api/routes/sweeps.py)."""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from service.database.models import Job, Sweep
from service.errors import FieldErrors, SpecError
from service.scheduling import jobs
from service.settings import Settings
from service.specs import normalization
from service.specs.policies import AUTO, POLICIES, loss_scale_mode_for
from service.specs.schemas import JobSpec, SweepSpec


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
