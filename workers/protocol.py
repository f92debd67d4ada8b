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


class Done(TypedDict):
    type: Literal["done"]
    status: Literal["succeeded", "failed", "cancelled"]
    error: str | None
    retryable: bool


Message = Started | Steps | EpochMetrics | Checkpointed | Warning_ | Forensics | Note | Saved | Done
