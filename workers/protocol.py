"""What the training child tells its supervisor, over a one-way pipe. Plain dicts of plain
values, so nothing on the supervisor side needs TensorFlow to unpickle them."""

from __future__ import annotations

from typing import Any, Literal, TypedDict


class JobError(Exception):
    """A failure the job's own spec or data explains (bad file, a guard tripped): retrying
    would fail the same way, so the job fails at once."""


class Started(TypedDict):
    type: Literal["started"]
    total_steps: int
    steps_per_epoch: int
    start_step: int
    steps_per_execution: int
    precision_report: list[dict[str, Any]]
    device: dict[str, Any]


class Compiling(TypedDict):
    """Sent before a step function's first call, which traces and compiles it: for a big
    model that can take minutes, and the supervisor's watchdog counts it as starting up."""

    type: Literal["compiling"]
    what: str


class Steps(TypedDict):
    type: Literal["steps"]
    # (step, epoch, loss, loss_scale, finite) per step, in step order.
    records: list[tuple[int, int, float, float, bool]]
    steps_per_second: float | None


class EpochMetrics(TypedDict):
    type: Literal["metrics"]
    epoch: int
    metrics: dict[str, float]


class Checkpointed(TypedDict):
    type: Literal["checkpoint"]
    step: int


class Warning_(TypedDict):
    type: Literal["warning"]
    message: str | None


class Forensics(TypedDict):
    type: Literal["forensics"]
    report: dict[str, Any]


class Note(TypedDict):
    """Something the job's notes should say (how a code job's pipeline resumed, what its
    saved model needs to load)."""

    type: Literal["note"]
    message: str


class Saved(TypedDict):
    """Files the job saved in its folder (the model), for the supervisor to store."""

    type: Literal["saved"]
    names: list[str]


class Figures(TypedDict):
    """The gradient figures of a sampled step, for the whole model or one variable
    (``workers.gradstats``). A figure is None where it is undefined, never inf or NaN; the
    last three are None on a step without the float32 shadow."""

    finite: bool
    zero_share: float | None
    log2_max: float | None
    log2_min_nonzero: float | None
    headroom: float | None
    subnormal_share: float | None
    underflow_share: float | None
    lost_share: float | None
    relative_error: float | None


class VariableSample(Figures):
    name: str


class Sample(Figures):
    """One sampled step: the whole model's figures, then each variable's."""

    step: int
    loss_scale: float
    shadow: bool
    variables: list[VariableSample]


class Gradients(TypedDict):
    type: Literal["gradients"]
    samples: list[Sample]  # in step order


class Probe(TypedDict):
    """One candidate policy's short probe (precision.policy "auto")."""

    policy: str
    median_step_seconds: float | None
    mean_loss: float | None
    loss_gap: float | None
    overflow_steps: int
    steps: int
    underflow_share: float | None
    lost_share: float | None
    eligible: bool
    why: str


class DecisionRecord(TypedDict):
    policy: str
    reason: str
    probes: list[Probe]


class Decision(TypedDict):
    """The auto policy's pick, sent once, before "started". The supervisor stores it on the
    job and hands it to every later attempt (payload "precision_decision")."""

    type: Literal["decision"]
    decision: DecisionRecord


class Alarm(TypedDict):
    """A gradient alarm's explanation, for the job's warnings (kept once)."""

    type: Literal["alarm"]
    message: str


class Done(TypedDict):
    type: Literal["done"]
    status: Literal["succeeded", "failed", "cancelled"]
    error: str | None
    retryable: bool


Message = (
    Started
    | Compiling
    | Steps
    | EpochMetrics
    | Checkpointed
    | Warning_
    | Forensics
    | Note
    | Saved
    | Gradients
    | Decision
    | Alarm
    | Done
)
