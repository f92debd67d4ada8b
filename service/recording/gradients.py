"""Gradient samples: the statistics of the scaled gradient at every ``gradients.every``-th
step (model level and per variable), stored beside the step history with the same
discipline: written by the supervisor's fenced flush, idempotent on ``(job_id, step)``, cut
with the history on a resume, every read a bounded range of the primary key. No TensorFlow.

The job's ``gradients_summary`` keeps the latest sample and the latest shadow sample (model
level), so a job's page needs no query of its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import delete, select, true
from sqlalchemy.orm import Session

from service.database.db import Database, upsert
from service.database.models import GradientSample, Job
from service.recording import columnar
from service.vocabulary import GRADIENT_FIGURES, GRADIENT_MODEL_ROW

FIGURES = GRADIENT_FIGURES
# What a sample has besides the figures and its variables.
HEAD = ("step", "loss_scale", "shadow", "finite")
MODEL_COLUMNS = (*HEAD, *FIGURES)
MODEL_ROW = GRADIENT_MODEL_ROW
# A sample comes from the training child, which runs the user's code: whatever it sends is
# kept within these bounds rather than trusted.
MAX_VARIABLES = 4096
MAX_NAME = 200
MAX_STEP = columnar.MAX_STEP
# Samples per query when a whole run is streamed out (Arrow, Parquet).
CHUNK_SAMPLES = 1000


def _figure(value: Any) -> float | None:
    """A figure as a finite float, or None (undefined; JSON has no NaN or infinity)."""
    if value is None or isinstance(value, bool):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def clean_sample(sample: Mapping[str, Any]) -> dict[str, Any]:
    """A sample as the child sent it, made safe to store: the step an int in range, the
    scale a finite float, the flags booleans, each figure a finite float or None, at most
    ``MAX_VARIABLES`` variables with names cut to ``MAX_NAME``. Raises ValueError (or
    TypeError) on a sample that is not one at all."""
    step = sample["step"]
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"a gradient sample's step must be an int in 0..{MAX_STEP}: {step!r}")
    scale = _figure(sample["loss_scale"])
    if scale is None:
        raise ValueError(f"a gradient sample's loss_scale must be finite: {sample['loss_scale']!r}")
    out: dict[str, Any] = {
        "step": step,
        "loss_scale": scale,
        "shadow": bool(sample.get("shadow", False)),
        "finite": bool(sample.get("finite", True)),
    }
    out |= {name: _figure(sample.get(name)) for name in FIGURES}
    variables = sample.get("variables") or []
    out["variables"] = [
        {
            "name": str(v.get("name", ""))[:MAX_NAME],
            "finite": bool(v.get("finite", True)),
            **{name: _figure(v.get(name)) for name in FIGURES},
        }
        for v in list(variables)[:MAX_VARIABLES]
    ]
    return out


def clean_json(value: Any, depth: int = 0) -> Any:
    """A JSON value with every non-finite float made null (PostgreSQL's JSON refuses NaN,
    and the API never sends it) and anything else that is not JSON made text."""
    if depth > 8:
        return None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): clean_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v, depth + 1) for v in value]
    return _figure(value) if hasattr(value, "__float__") else str(value)


def clean_decision(decision: Mapping[str, Any]) -> dict[str, Any]:
    """The auto policy's decision as the child sent it, made safe to store and to answer
    with (``responses.PrecisionDecisionOut``): a policy, a reason, a list of probes each
    with its policy. Raises ValueError (or TypeError) on one that is not a decision."""
    out = clean_json(dict(decision))
    if not isinstance(out.get("policy"), str) or not out["policy"]:
        raise ValueError(f"a precision decision needs a policy: {out.get('policy')!r}")
    out["reason"] = str(out.get("reason") or "")
    probes = out.get("probes") or []
    if not isinstance(probes, list) or not all(
        isinstance(p, dict) and isinstance(p.get("policy"), str) for p in probes
    ):
        raise ValueError("a precision decision's probes must each be an object with a policy")
    out["probes"] = [_probe(p) for p in probes]
    return out  # type: ignore[no-any-return]


_PROBE_FLOATS = ("median_step_seconds", "mean_loss", "loss_gap", "underflow_share", "lost_share")
_PROBE_COUNTS = ("overflow_steps", "steps")


def _probe(probe: dict[str, Any]) -> dict[str, Any]:
    """A probe's known fields in their types (unknown ones kept as they are)."""
    out = dict(probe)
    out |= {name: _figure(probe.get(name)) for name in _PROBE_FLOATS}
    for name in _PROBE_COUNTS:
        count = _figure(probe.get(name))
        out[name] = None if count is None else int(count)
    out["eligible"] = bool(probe.get("eligible", False))
    out["why"] = str(probe.get("why") or "")
    return out


def model_level(sample: Mapping[str, Any]) -> dict[str, Any]:
    """A sample without its variables (what the job's summary keeps)."""
    return {name: sample[name] for name in MODEL_COLUMNS}


# --------------------------------------------------------------------------------------------
# Writing


def write_samples(session: Session, job: Job, samples: Sequence[Mapping[str, Any]]) -> None:
    """Store samples (cleaned by ``clean_sample``) and fold them into the job's summary.

    A sample stored already is replaced. Only a resent batch can meet one (a commit whose
    acknowledgement was lost: the same values), since a resumed attempt's samples from its
    cut on were deleted by the truncation that precedes them in the same transaction; and
    replacing keeps the rule simple that the summary holds exactly what the rows hold. A
    few rows per flush, so DO UPDATE costs nothing that matters (unlike the step rows')."""
    if not samples:
        return
    by_step = {s["step"]: s for s in samples}  # one row per step, the last sent winning
    upsert(
        session,
        GradientSample.__table__,  # type: ignore[arg-type]
        [{"job_id": job.id, **s} for s in by_step.values()],
        ["job_id", "step"],
    )
    summary = dict(job.gradients_summary or {"latest": None, "latest_shadow": None})
    for key, candidates in (
        ("latest", list(by_step.values())),
        ("latest_shadow", [s for s in by_step.values() if s["shadow"]]),
    ):
        newest = max(candidates, key=lambda s: s["step"], default=None)
        held = summary.get(key)
        if newest is not None and (held is None or newest["step"] >= held["step"]):
            summary[key] = model_level(newest)
    job.gradients_summary = summary


def truncate_samples(session: Session, job: Job, step: int) -> int:
    """Forget the samples from ``step`` on (a resumed attempt samples those steps again) and
    recompute the summary from what remains. Returns how many were forgotten."""
    forgotten = session.execute(
        delete(GradientSample).where(GradientSample.job_id == job.id, GradientSample.step >= step)
    )
    count = int(forgotten.rowcount)  # type: ignore[attr-defined]
    if count:
        job.gradients_summary = summary_from_rows(session, job.id)
    return count


def summary_from_rows(session: Session, job_id: int) -> dict[str, Any] | None:
    """The summary as the stored samples give it: two probes of an index, from the end."""
    latest = _last(session, job_id, shadow_only=False)
    if latest is None:
        return None
    return {"latest": latest, "latest_shadow": _last(session, job_id, shadow_only=True)}


def _model_columns() -> list[Any]:
    return [getattr(GradientSample, name) for name in MODEL_COLUMNS]


def _last(session: Session, job_id: int, *, shadow_only: bool) -> dict[str, Any] | None:
    query = select(*_model_columns()).where(GradientSample.job_id == job_id)
    if shadow_only:
        # ``= true``, not ``IS true``: an equality the (job_id, shadow, step) index serves.
        query = query.where(GradientSample.shadow == true())
    row = session.execute(query.order_by(GradientSample.step.desc()).limit(1)).one_or_none()
    return None if row is None else dict(row._mapping)


# --------------------------------------------------------------------------------------------
# Reading


def read_samples(
    session: Session, job_id: int, *, after_step: int, limit: int, variables: bool = True
) -> tuple[list[dict[str, Any]], bool]:
    """Samples with step > after_step, in step order, at most ``limit``; the bool says
    whether more follow. ``variables=False``: model level only (the JSON lists not read)."""
    columns = _model_columns()
    if variables:
        columns.append(GradientSample.variables)
    rows = session.execute(
        select(*columns)
        .where(GradientSample.job_id == job_id, GradientSample.step > after_step)
        .order_by(GradientSample.step)
        .limit(limit + 1)
    ).all()
    return [dict(r._mapping) for r in rows[:limit]], len(rows) > limit


def _dumps(page: dict[str, Any]) -> bytes:
    return json.dumps(page, separators=(",", ":"), allow_nan=False).encode()


def samples_body(job_id: int, version: int, samples: list[dict[str, Any]], has_more: bool) -> bytes:
    """A JSON page: the samples with their variables, and the cursor of the next page
    (null when no more samples are stored right now)."""
    return _dumps(
        {
            "job_id": job_id,
            "history_version": version,
            "samples": samples,
            "next_after_step": samples[-1]["step"] if has_more else None,
        }
    )


def columns_body(job_id: int, version: int, samples: list[dict[str, Any]], has_more: bool) -> bytes:
    """Model-level figures as one array per field (the shape chart libraries take)."""
    return _dumps(
        {
            "job_id": job_id,
            "history_version": version,
            "columns": {name: [s[name] for s in samples] for name in MODEL_COLUMNS},
            "next_after_step": samples[-1]["step"] if has_more else None,
        }
    )


def iter_samples(
    db: Database, job_id: int, *, after_step: int, limit: int | None
) -> Iterator[list[dict[str, Any]]]:
    """Samples after ``after_step`` (at most ``limit``; None: all) in chunks, each read in a
    short transaction of its own: constant memory, and no snapshot held open while a slow
    client downloads."""
    left = MAX_STEP if limit is None else limit
    while left > 0:
        with db.read() as session:
            chunk, more = read_samples(
                session, job_id, after_step=after_step, limit=min(CHUNK_SAMPLES, left)
            )
        if chunk:
            yield chunk
            after_step = chunk[-1]["step"]
            left -= len(chunk)
        if not more:
            return


# --------------------------------------------------------------------------------------------
# The long table: one row per (step, variable), the model's own row first


def arrow_schema(job_id: int) -> Any:
    pa = columnar.pyarrow()
    return pa.schema(
        [
            pa.field("step", pa.int32(), nullable=False),
            pa.field("variable", pa.string(), nullable=False),
            pa.field("loss_scale", pa.float64(), nullable=False),
            pa.field("shadow", pa.bool_(), nullable=False),
            pa.field("finite", pa.bool_(), nullable=False),
            *(pa.field(name, pa.float64()) for name in FIGURES),
        ],
        metadata={"halfway.job_id": str(job_id), "halfway.model_row": MODEL_ROW},
    )


def long_batch(schema: Any, samples: list[dict[str, Any]]) -> Any:
    """A record batch of the long table for these samples."""
    pa = columnar.pyarrow()
    rows: dict[str, list[Any]] = {field.name: [] for field in schema}
    for s in samples:
        for v in [{"name": MODEL_ROW, **s}, *s["variables"]]:
            rows["step"].append(s["step"])
            rows["variable"].append(v["name"])
            rows["loss_scale"].append(s["loss_scale"])
            rows["shadow"].append(s["shadow"])
            rows["finite"].append(v.get("finite", s["finite"]))
            for name in FIGURES:
                rows[name].append(v.get(name))
    return pa.record_batch([pa.array(rows[f.name], f.type) for f in schema], schema=schema)


def long_table_stream(
    chunks: Iterator[list[dict[str, Any]]], job_id: int, kind: str
) -> Iterator[bytes]:
    """The long table as an Arrow IPC stream (``kind="arrow"``) or a Parquet file."""
    schema = arrow_schema(job_id)
    batches = (long_batch(schema, chunk) for chunk in chunks)
    if kind == "arrow":
        return columnar.arrow_batches(schema, batches)
    return columnar.parquet_batches(schema, batches)
