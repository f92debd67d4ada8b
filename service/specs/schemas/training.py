"""How a job trains: the optimizer and its schedule, the loss and metrics, the epochs and
checkpoints, and what it watches while training (faults, guards, forensics, gradients)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.specs.schemas.base import MAX_INT32, StrictModel


def _only_when(names: list[str], absent: list[str]) -> dict[str, Any]:
    """JSON Schema for "with one of these names, these arguments are null or left out"."""
    return {
        "if": {"properties": {"name": {"enum": names}}},
        "then": {"properties": {field: {"type": "null"} for field in absent}},
    }


class ScheduleSpec(StrictModel):
    """A learning-rate schedule from the optimizer's learning_rate, with an optional linear
    warm-up from 0 over ``warmup_steps`` first (the schedule then starts after it)."""

    kind: Literal["constant", "cosine_decay", "exponential_decay", "piecewise_constant"] = (
        "constant"
    )
    warmup_steps: int = Field(default=0, ge=0, le=10**9)
    decay_steps: int | None = Field(
        default=None, ge=1, le=10**9, description="cosine_decay and exponential_decay"
    )
    alpha: float | None = Field(
        default=None, ge=0, le=1, description="cosine_decay: the final fraction of the rate"
    )
    decay_rate: float | None = Field(default=None, gt=0, le=1, description="exponential_decay")
    staircase: bool | None = Field(default=None, description="exponential_decay")
    boundaries: list[Annotated[int, Field(ge=0, le=10**9)]] | None = Field(
        default=None, max_length=1000, description="piecewise_constant: steps, ascending"
    )
    values: list[Annotated[float, Field(gt=0, le=10)]] | None = Field(
        default=None,
        max_length=1001,
        description="piecewise_constant: one more rate than boundaries",
    )

    @model_validator(mode="after")
    def _arguments_fit(self) -> ScheduleSpec:
        allowed = {
            "constant": set(),
            "cosine_decay": {"decay_steps", "alpha"},
            "exponential_decay": {"decay_steps", "decay_rate", "staircase"},
            "piecewise_constant": {"boundaries", "values"},
        }[self.kind]
        for field in ("decay_steps", "alpha", "decay_rate", "staircase", "boundaries", "values"):
            if getattr(self, field) is not None and field not in allowed:
                raise PydanticCustomError(
                    "argument_not_for_schedule", f"{field} is not an argument of {self.kind}"
                )
        needed = {
            "cosine_decay": ["decay_steps"],
            "exponential_decay": ["decay_steps", "decay_rate"],
            "piecewise_constant": ["boundaries", "values"],
        }.get(self.kind, [])
        for field in needed:
            if getattr(self, field) is None:
                raise PydanticCustomError("missing", f"{self.kind} needs {field}")
        if self.kind == "piecewise_constant":
            assert self.boundaries is not None and self.values is not None
            if sorted(set(self.boundaries)) != self.boundaries:
                raise PydanticCustomError(
                    "boundaries", "boundaries must be strictly ascending steps"
                )
            if len(self.values) != len(self.boundaries) + 1:
                raise PydanticCustomError(
                    "values", "piecewise_constant needs one more value than boundaries"
                )
        return self


class OptimizerSpec(StrictModel):
    # The arguments each optimizer takes, as the validator below checks them (an absent name
    # is adam, which the first rule covers: an absent property satisfies "properties").
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                _only_when(["adam", "adamw"], ["momentum", "nesterov"]),
                _only_when(["sgd"], ["beta_1", "beta_2"]),
                _only_when(["rmsprop"], ["nesterov", "beta_1", "beta_2"]),
            ]
        }
    )

    name: Literal["adam", "adamw", "sgd", "rmsprop"] = "adam"
    learning_rate: float = Field(default=0.001, gt=0, le=10)
    momentum: float | None = Field(default=None, ge=0, lt=1, description="sgd and rmsprop")
    nesterov: bool | None = Field(default=None, description="sgd")
    beta_1: float | None = Field(default=None, gt=0, lt=1, description="adam and adamw")
    beta_2: float | None = Field(default=None, gt=0, lt=1, description="adam and adamw")
    epsilon: float | None = Field(default=None, gt=0, le=1)
    weight_decay: float | None = Field(default=None, ge=0, le=1)
    clipnorm: float | None = Field(default=None, gt=0, le=1e6)
    schedule: ScheduleSpec = Field(
        default_factory=lambda: ScheduleSpec(kind="constant"),
        description="How learning_rate changes with the optimizer's (applied) steps.",
    )

    @model_validator(mode="after")
    def _arguments_fit(self) -> OptimizerSpec:
        allowed = {
            "adam": {"beta_1", "beta_2"},
            "adamw": {"beta_1", "beta_2"},
            "sgd": {"momentum", "nesterov"},
            "rmsprop": {"momentum"},
        }[self.name]
        for field in ("momentum", "nesterov", "beta_1", "beta_2"):
            if getattr(self, field) is not None and field not in allowed:
                raise PydanticCustomError(
                    "argument_not_for_optimizer",
                    f"{field} is not an argument of {self.name}",
                )
        return self


LossName = Literal[
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
    "mean_squared_error",
    "mean_absolute_error",
    "huber",
    "log_cosh",
]
LOSS_ALIASES = {"mse": "mean_squared_error", "mae": "mean_absolute_error"}
# The arguments each built-in loss takes (Keras 3's own names).
LOSS_ARGUMENTS: dict[str, set[str]] = {
    "sparse_categorical_crossentropy": {"from_logits"},
    "categorical_crossentropy": {"from_logits", "label_smoothing"},
    "binary_crossentropy": {"from_logits", "label_smoothing"},
    "mean_squared_error": set(),
    "mean_absolute_error": set(),
    "huber": {"delta"},
    "log_cosh": set(),
}
REGRESSION_LOSSES = ("mean_squared_error", "mean_absolute_error", "huber", "log_cosh")


def _loss_object(value: Any) -> Any:
    if isinstance(value, str):
        value = {"name": value}
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        value = {**value, "name": LOSS_ALIASES.get(value["name"], value["name"])}
    return value


class LossSpec(StrictModel):
    """A Keras built-in loss by name (or ``{name, from_logits, label_smoothing, delta}``)."""

    name: LossName
    from_logits: bool | None = None
    label_smoothing: float | None = Field(default=None, ge=0, lt=1)
    delta: float | None = Field(default=None, gt=0, le=1e6, description="huber")

    @model_validator(mode="after")
    def _arguments_fit(self) -> LossSpec:
        for field in ("from_logits", "label_smoothing", "delta"):
            if getattr(self, field) is not None and field not in LOSS_ARGUMENTS[self.name]:
                raise PydanticCustomError(
                    "argument_not_for_loss", f"{field} is not an argument of {self.name}"
                )
        return self


MetricName = Literal[
    "accuracy",
    "sparse_categorical_accuracy",
    "categorical_accuracy",
    "binary_accuracy",
    "top_5_accuracy",
    "mean_squared_error",
    "mean_absolute_error",
    "root_mean_squared_error",
    "auc",
    "precision",
    "recall",
]


def _metric_name(value: Any) -> Any:
    return (
        {
            "mse": "mean_squared_error",
            "mae": "mean_absolute_error",
            "rmse": ("root_mean_squared_error"),
        }.get(value, value)
        if isinstance(value, str)
        else value
    )


class TrainingSpec(StrictModel):
    epochs: int = Field(default=5, ge=1, le=100_000)
    batch_size: int = Field(default=32, ge=1, le=65_536)
    steps_per_epoch: int | None = Field(default=None, ge=1, le=10**7)
    validation_split: float = Field(default=0.0, ge=0, le=0.5)
    seed: int = Field(default=0, ge=0, le=MAX_INT32)
    steps_per_execution: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="Steps run per graph execution; default chosen so the host syncs rarely.",
    )
    jit_compile: bool | Literal["auto"] = Field(
        default="auto",
        description="XLA-compile the train step. 'auto' is Keras' default: on with a GPU, off on "
        "a CPU-only worker.",
    )
    checkpoint_every: int = Field(
        default=1000, ge=1, le=10**9, description="Steps between resumable checkpoints."
    )
    target_loss: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="Record when the loss (mean of the last 50 steps) first reaches this.",
    )
    loss: Annotated[LossSpec, BeforeValidator(_loss_object)] = Field(
        default_factory=lambda: LossSpec(name="sparse_categorical_crossentropy"),
        description="A Keras built-in loss: a name (mse and mae are accepted) or "
        "{name, from_logits, label_smoothing, delta}.",
    )
    metrics: list[Annotated[MetricName, BeforeValidator(_metric_name)]] | None = Field(
        default=None,
        max_length=20,
        description="Keras built-in metrics by name; default: accuracy for classification "
        "losses, none for regression.",
    )


class FaultsSpec(StrictModel):
    """Rehearsal: inject failures so you see how a config reacts (and so tests can)."""

    nonfinite_at_steps: list[Annotated[int, Field(ge=0, le=10**9)]] = Field(
        default_factory=list,
        max_length=10_000,
        description="Global steps at which the child makes the gradients non-finite.",
    )
    nonfinite_variables: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list,
        max_length=100,
        description="Only the gradients of variables whose path contains one of these (e.g. "
        "'dense_0/kernel') are made non-finite; empty: all of them.",
    )
    crash_at_step: int | None = Field(
        default=None, ge=0, le=10**9, description="Raise an exception at this step."
    )
    hang_at_step: int | None = Field(
        default=None, ge=0, le=10**9, description="Stop making progress at this step."
    )
    crash_attempts: list[Annotated[int, Field(ge=1, le=1000)]] | None = Field(
        default=None,
        max_length=100,
        description="The attempts on which crash_at_step and hang_at_step happen (default: "
        "every attempt): [1] rehearses a crash and the resumed attempt that recovers from it.",
    )

    @field_validator("nonfinite_at_steps")
    @classmethod
    def _sorted_unique(cls, steps: list[int]) -> list[int]:
        return sorted(set(steps))


class GuardsSpec(StrictModel):
    """Stop a run that loss scaling cannot save; each guard can be switched off with null."""

    max_consecutive_nonfinite: int | None = Field(
        default=200,
        ge=1,
        le=10**9,
        description="Fail after this many non-finite (skipped) steps in a row.",
    )
    fail_on_nonfinite_loss: bool = Field(
        default=True,
        description="Fail when the loss is non-finite although the gradients were finite "
        "(loss scaling cannot explain it: the model itself diverged).",
    )
    max_steps_at_min_scale: int | None = Field(
        default=1000,
        ge=1,
        le=10**9,
        description="Fail when the scale has sat at min_scale this many steps in a row.",
    )
    overflow_warn_rate: float | None = Field(
        default=0.05, gt=0, le=1, description="Warn above this overflow rate; null: never."
    )
    overflow_window: int = Field(default=1000, ge=10, le=10**7)


class ForensicsSpec(StrictModel):
    captures: int = Field(
        default=1,
        ge=0,
        le=100,
        description="On the job's first N non-finite steps, record which variables had "
        "non-finite gradients, with the loss and the scale (0: off).",
    )


class GradientsSpec(StrictModel):
    """The gradient meter, which shows whether the loss scale does its job: how close this
    run's gradients come to float16's limits (small ones flushing to zero, large ones
    overflowing), sampled while it trains. A sample costs a fraction of a step and a shadow
    sample under one; only executions holding a sampled step run the metered step, so the
    defaults cost about 3% of a step (docs/results.md has the measured figures). Both periods 0
    take the meter out."""

    every: int = Field(
        default=250,
        ge=0,
        le=10**9,
        description="Record the gradient statistics (zero share, range, headroom below "
        "float16's largest value, subnormal share) at every step divisible by this; 0: only "
        "at shadow steps (both 0: the meter is off).",
    )
    shadow_every: int = Field(
        default=1000,
        ge=0,
        le=10**9,
        description="At every step divisible by this, also compute the same batch's gradient "
        "in float32 (the shadow, about one extra step each time) to measure what underflows "
        "at the current loss scale and what this run lost to zero; a shadow step is always "
        "sampled too. 0: no shadow.",
    )
    alarm_share: float | None = Field(
        default=0.05,
        gt=0,
        le=1,
        description="Warn when the underflow or lost share stays above this for alarm_samples "
        "shadow samples in a row; null: never.",
    )
    alarm_samples: int = Field(
        default=3,
        ge=1,
        le=10**6,
        description="Shadow samples in a row above alarm_share before the alarm fires.",
    )
    guard: bool = Field(
        default=False, description="Fail the job when an alarm fires, instead of only warning."
    )
