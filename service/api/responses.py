"""What the API answers: jobs and their summaries, history pages (rows, columns, buckets),
scale events, comparisons, sweeps, policies and errors. Built from ORM rows and domain
results; what users write (the job spec) is in service/specs/schemas/."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from service.vocabulary import QueueReason


def loss_flag(value: float | None) -> Literal["nan", "inf", "-inf"] | None:
    """JSON has no NaN: a non-finite float goes out as null plus this flag."""
    if value is None or math.isfinite(value):
        return None
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


# Jobs and history pages carry the history's version: what it means, said once.
HISTORY_VERSION = (
    "Moves on each time a resume replaces recorded steps. A client holding rows of the version "
    "before starts again from history_reset_step; of an older one, from step 0."
)
HISTORY_RESET_STEP = "The first step the latest rewrite replaced (null: never rewritten)."


def json_float(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


class Progress(BaseModel):
    step: int | None = Field(description="Steps done (last step + 1).")
    total_steps: int | None
    fraction: float | None
    epoch: int | None


class Summary(BaseModel):
    last_step: int | None
    last_loss: float | None
    last_loss_nonfinite: Literal["nan", "inf", "-inf"] | None
    loss_scale: float | None
    min_loss_scale: float | None
    overflow_count: int = Field(description="Steps whose gradients were not all finite.")
    growth_count: int = Field(description="Times the loss scale grew.")
    backoff_count: int = Field(description="Times the loss scale backed off.")
    nonfinite_loss_count: int
    steps_per_second: float | None
    guard_warning: str | None
    checkpoint_step: int | None
    metrics: dict[str, Any]


class Figures(BaseModel):
    """Gradient figures at one sampled step, of the whole model or one variable (as
    ``workers.protocol.Figures``). ``G`` is the gradient of the scaled loss as the optimizer
    received it (before unscaling), ``S`` the step's loss scale; a figure is null where it is
    undefined."""

    finite: bool = Field(description="All elements of G finite.")
    zero_share: float | None = Field(description="Share of the elements of G exactly zero.")
    log2_max: float | None = Field(description="log2 of the largest |G|.")
    log2_min_nonzero: float | None = Field(description="log2 of the smallest nonzero |G|.")
    headroom: float | None = Field(
        description="Doublings left before float16's largest finite value (65504)."
    )
    subnormal_share: float | None = Field(
        description="Share of the nonzero elements of G below 2^-14 (float16 subnormals)."
    )
    underflow_share: float | None = Field(
        description="Shadow steps: share of the nonzero elements of the float32 gradient g32 "
        "whose magnitude times S is below 2^-24 (they flush to zero in float16)."
    )
    lost_share: float | None = Field(
        description="Shadow steps: elements nonzero in g32 but zero in G (what the run lost)."
    )
    relative_error: float | None = Field(description="Shadow steps: |G/S - g32| / |g32|.")


class GradientFigures(Figures):
    """The whole model's gradient figures at one sampled step."""

    step: int
    loss_scale: float = Field(description="S: the scale that multiplied this step's loss.")
    shadow: bool = Field(description="Whether the float32 shadow ran at this step.")


class VariableFigures(Figures):
    """One trainable variable's figures at a sampled step."""

    name: str


class GradientSampleOut(GradientFigures):
    variables: list[VariableFigures] = Field(description="Each trainable variable's figures.")


class GradientsPage(BaseModel):
    """``GET /v1/jobs/{id}/gradients``: sampled steps in step order."""

    job_id: int
    history_version: int = Field(
        description="As the history's: a resume that cut samples moves it on (start over)."
    )
    samples: list[GradientSampleOut]
    next_after_step: int | None = Field(
        description="Pass as ?after_step= for the next page; null when no more samples are "
        "stored right now (poll again from the last step you hold)."
    )


class GradientColumns(BaseModel):
    step: list[int]
    loss_scale: list[float]
    shadow: list[bool]
    finite: list[bool]
    zero_share: list[float | None]
    log2_max: list[float | None]
    log2_min_nonzero: list[float | None]
    headroom: list[float | None]
    subnormal_share: list[float | None]
    underflow_share: list[float | None]
    lost_share: list[float | None]
    relative_error: list[float | None]


class GradientColumnsPage(BaseModel):
    """``?format=columns``: the model-level figures as one array per field."""

    job_id: int
    history_version: int
    columns: GradientColumns
    next_after_step: int | None = Field(description="As in the JSON page.")


class GradientsSummary(BaseModel):
    latest: GradientFigures | None = Field(description="The last sampled step.")
    latest_shadow: GradientFigures | None = Field(
        description="The last step sampled with the float32 shadow."
    )


class ProbeOut(BaseModel):
    """One candidate policy's probe (precision.policy "auto")."""

    model_config = ConfigDict(extra="allow")

    policy: str
    median_step_seconds: float | None = Field(None, description="After warm-up.")
    mean_loss: float | None = None
    loss_gap: float | None = Field(None, description="Against float32's loss.")
    overflow_steps: int | None = None
    steps: int | None = None
    underflow_share: float | None = None
    lost_share: float | None = None
    eligible: bool = False
    why: str = ""


class PrecisionDecisionOut(BaseModel):
    """What precision.policy "auto" chose, why, and the probes it chose from."""

    model_config = ConfigDict(extra="allow")

    policy: str
    reason: str = ""
    probes: list[ProbeOut] = Field(default_factory=list)


class QueueSpot(BaseModel):
    """Where a queued job waits (docs/scheduling.md)."""

    position: int | None = Field(
        description="1: the next claim takes it. Null: held back by the per-user cap, the "
        "budget, or no slot with its GPUs."
    )
    ahead: int = Field(description="Jobs the claims take before it.")
    reason: QueueReason = Field(
        description="next; priority (a higher-priority job is ahead); share (an owner further "
        "below their share is ahead); age (only older jobs of equal standing are ahead); "
        "per-user cap (the owner runs as many jobs as a user may); budget (the owner has used "
        "this window's slot-hours; it waits for the next window); no slot (it needs more GPUs "
        "than any live worker's slot holds)."
    )


class PreemptionOut(BaseModel):
    """One time a waiting job took this job's slot at a checkpoint (docs/scheduling.md)."""

    at: datetime = Field(description="When the job stopped (the database's clock).")
    by_job: int = Field(description="The waiting job it made room for.")
    reason: Literal["priority", "share"] = Field(
        description="priority (the waiting job's was higher) or share (its owner stood far "
        "below this job's owner's share)."
    )
    step: int | None = Field(description="The checkpoint it resumes from (null: the start).")


class JobOut(BaseModel):
    id: int
    name: str
    owner: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    priority: int
    attempt: int
    max_attempts: int
    worker_id: str | None
    cancel_requested: bool
    error: str | None
    attempt_errors: list[Any]
    warnings: list[str]
    notes: list[str]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    progress: Progress
    summary: Summary
    sweep_id: int | None
    precision_report: list[dict[str, Any]] = Field(
        description="Per layer: class, policy, variable, compute and output dtype, parameters."
    )
    forensics: list[dict[str, Any]] = Field(
        description="On the first non-finite steps: the step, loss, scale and the variables "
        "whose gradients were not finite."
    )
    device: dict[str, Any] = Field(description="Where it trained: GPUs, replicas, XLA, ...")
    spec: dict[str, Any]
    history_version: int = Field(description=HISTORY_VERSION)
    history_reset_step: int | None = Field(description=HISTORY_RESET_STEP)
    gradients: GradientsSummary | None = Field(
        None, description="The latest gradient sample and shadow sample (null: none yet)."
    )
    precision_decision: PrecisionDecisionOut | None = Field(
        None, description='precision.policy "auto": what was chosen and why (null: not yet).'
    )
    queue: QueueSpot | None = Field(
        None,
        description="A queued job's place in the claim order (null: not queued; not "
        "computed in the answers to submit, cancel and priority changes).",
    )
    preemptions: list[PreemptionOut] = Field(
        default_factory=list, description="Each preemption at a checkpoint, oldest first."
    )


class QueueItem(BaseModel):
    job_id: int
    name: str
    owner: str
    priority: int
    created_at: datetime
    position: int | None
    ahead: int
    reason: str
    owner_usage_seconds: float = Field(
        description="The owner's recent use: slot-seconds (GPU-seconds), decayed, running "
        "jobs included."
    )
    owner_weight: float
    owner_standing: float = Field(description="usage / weight: the lower, the sooner.")


class QueueOut(BaseModel):
    items: list[QueueItem] = Field(description="Queued jobs in claim order.")
    half_life_seconds: float


class ShareOut(BaseModel):
    owner: str
    weight: float
    share: float = Field(description="weight / the sum of every listed weight.")
    usage_seconds: float
    usage_share: float = Field(description="usage / the sum of every listed usage.")
    standing: float = Field(description="usage / weight: the claim serves the lowest first.")
    running: int
    window_spent_seconds: float = Field(
        description="Slot-seconds (GPU-seconds) used in the current budget window, undecayed, "
        "running jobs included."
    )


class SharesOut(BaseModel):
    items: list[ShareOut]
    half_life_seconds: float
    budget_seconds: float | None = Field(
        description="Slot-seconds each user's jobs may start within a window (null: no budget)."
    )
    window_seconds: float = Field(description="The budget window's length.")


class JobPage(BaseModel):
    items: list[JobOut]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next (older) page.")


class StepOut(BaseModel):
    step: int
    epoch: int
    loss: float | None
    loss_nonfinite: Literal["nan", "inf", "-inf"] | None
    loss_scale: float
    finite: bool


class HistoryPage(BaseModel):
    job_id: int
    status: str
    items: list[StepOut]
    next_after_step: int | None = Field(
        description="Pass as ?after_step= to get only newer rows (a polling cursor)."
    )
    has_more: bool
    history_version: int = Field(description=HISTORY_VERSION)
    history_reset_step: int | None = Field(description=HISTORY_RESET_STEP)


class MeOut(BaseModel):
    name: str = Field(description='The caller: its user name ("local" with auth off).')
    role: Literal["admin", "member"] = Field(
        description="admin may cancel and reprioritize any job; member only their own."
    )


class PolicyOut(BaseModel):
    name: str
    variable_dtype: str
    compute_dtype: str
    loss_scaling_advised: bool
    note: str


class ErrorField(BaseModel):
    field: str
    rule: str
    message: str


class ErrorOut(BaseModel):
    error: str = Field(description="A stable code: validation_error, not_found, conflict, ...")
    message: str
    fields: list[ErrorField] = Field(
        description="For invalid input: each field (a dotted path, or 'body') and the rule it "
        "broke. Empty for other errors."
    )


ERROR_DESCRIPTIONS = {
    401: "Missing or invalid token",
    403: "Not allowed: only the job's owner or an admin may change a job, and only users "
    "with the right to run code (HALFWAY_CODE_JOBS) may upload or submit code",
    404: "No such job or sweep",
    409: "Conflicts with the resource's state",
    413: "Request body over the server's limit",
    422: "Invalid input; names each field and the rule it broke",
    429: "Too many failed authentications from this address; see Retry-After",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, all with the ErrorOut body. Where a token
    is checked (401), so is the failed-authentication limit (429)."""
    if 401 in codes:
        codes = (*codes, 429)
    out: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorOut, "description": ERROR_DESCRIPTIONS[code]} for code in codes
    }
    if 429 in out:
        out[429]["headers"] = {
            "Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}}
        }
    return out


class BucketOut(BaseModel):
    index: int = Field(description="Bucket number on the grid (see BucketPage.width).")
    first_step: int
    last_step: int
    count: int = Field(description="Steps recorded in the bucket.")
    loss_min: float | None = Field(description="Over the bucket's finite losses.")
    loss_max: float | None
    loss_last: float | None
    loss_last_nonfinite: Literal["nan", "inf", "-inf"] | None
    scale_min: float
    scale_max: float
    scale_last: float
    overflow_count: int = Field(description="Steps whose gradients were not all finite.")
    nonfinite_loss_count: int


class BucketPage(BaseModel):
    job_id: int
    status: str
    from_step: int
    to_step: int
    points: int = Field(description="Buckets asked for; at most this many are returned.")
    width: int = Field(description="Steps per bucket (the last one may hold fewer).")
    origin: int = Field(description="Bucket i starts at step origin + i * width.")
    buckets: list[BucketOut] = Field(description="Non-empty buckets, in step order.")
    history_version: int = Field(description=HISTORY_VERSION)
    history_reset_step: int | None = Field(description=HISTORY_RESET_STEP)


class ColumnsPage(BaseModel):
    """``history?format=columns``: the rows as one array per field (the shape chart libraries
    take), in step order."""

    job_id: int
    status: str
    step: list[int]
    epoch: list[int]
    loss: list[float | None] = Field(description="null where loss_nonfinite says why.")
    loss_nonfinite: list[Literal["nan", "inf", "-inf"] | None]
    loss_scale: list[float]
    finite: list[bool]
    next_after_step: int | None = Field(
        description="Pass as ?after_step= to get only newer rows (a polling cursor)."
    )
    has_more: bool
    history_version: int = Field(description="As in a row page: moves on with each rewrite.")
    history_reset_step: int | None = Field(description=HISTORY_RESET_STEP)


class ScaleEventOut(BaseModel):
    step: int = Field(description="The first step that used the new scale.")
    old_scale: float
    new_scale: float
    reason: Literal["overflow", "growth"]


class ScaleEventPage(BaseModel):
    job_id: int
    items: list[ScaleEventOut]
    next_after_step: int | None
    has_more: bool
    overflow_events: int = Field(description="Back-offs over the whole job.")
    growth_events: int = Field(description="Growths over the whole job.")


class ComparedJob(BaseModel):
    job_id: int
    name: str
    status: str
    policy: str
    buckets: list[BucketOut]
    history_version: int


class Comparison(BaseModel):
    from_step: int
    to_step: int
    points: int
    width: int
    origin: int
    jobs: list[ComparedJob] = Field(description="Every job on the same bucket grid.")


class VariantResult(BaseModel):
    job_id: int
    name: str
    status: str
    error: str | None
    policy: str
    loss_scale_mode: str
    examples_per_second: float | None
    median_step_seconds: float | None = Field(description="Median after warm-up.")
    speedup_vs_float32: float | None
    time_to_target_seconds: float | None
    step_to_target: int | None
    final_loss: float | None = Field(description="The last epoch's mean training loss.")
    final_metrics: dict[str, float] = Field(description="The last epoch's metrics.")
    overflow_count: int
    skipped_steps: int = Field(description="Updates skipped because gradients were not finite.")
    final_loss_scale: float | None
    min_loss_scale: float | None
    peak_memory_bytes: float | None = Field(description="Where the device reports it (GPUs).")
    underflow_share: float | None = Field(
        default=None,
        description="At the variant's latest float32-shadow sample: the share of gradient "
        "elements float16 flushes at its loss scale (what it would flush, for a variant that "
        "does not compute in float16).",
    )
    lost_share: float | None = Field(
        default=None,
        description="At the same sample: the share of gradient elements this variant lost.",
    )


class SweepOut(BaseModel):
    id: int
    name: str
    owner: str
    created_at: datetime
    target_loss: float | None
    done: bool
    variants: list[VariantResult]
