"""The precision a job trains in (a Keras policy, an explicit dtype pair, or ``auto`` chosen
by probes) and its loss scaling (docs/concepts.md)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.specs.policies import (
    AUTO,
    AUTO_CANDIDATES,
    POLICIES,
    PolicyChoice,
    UnexpressiblePolicy,
    policy_for_pair,
)
from service.specs.schemas.base import LEGACY_AMP_ENV, LEGACY_AMP_EXPLANATION, StrictModel


class DtypePair(StrictModel):
    """An explicit dtype pair, as the old ``Policy('custom', {...})`` examples show."""

    name: Literal["custom"] | None = Field(
        default=None, description="Accepted for the old Policy('custom', {...}) form; ignored."
    )
    variable_dtype: Literal["float16", "bfloat16", "float32", "float64"]
    compute_dtype: Literal["float16", "bfloat16", "float32", "float64"]


def _policy_name(value: Any) -> Any:
    """Turn a dtype pair into the Keras name it means; a pair Keras cannot express is an error."""
    if not isinstance(value, dict):
        return value
    try:
        pair = DtypePair.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise PydanticCustomError(
            "dtype_pair",
            "an explicit policy needs variable_dtype and compute_dtype ({problems})",
            {"problems": problems},
        ) from None
    try:
        return policy_for_pair(pair.variable_dtype, pair.compute_dtype)
    except UnexpressiblePolicy as exc:
        raise PydanticCustomError("unexpressible_policy", str(exc)) from None


def _pair_schema(variable: str, compute: str) -> dict[str, Any]:
    pair = DtypePair.model_json_schema()
    properties = {
        **pair["properties"],
        "variable_dtype": {"const": variable},
        "compute_dtype": {"const": compute},
    }
    return {**pair, "properties": properties}


# Only the pairs a Keras policy has: the others are refused (unexpressible_policy).
PolicyField = Annotated[
    PolicyChoice,
    BeforeValidator(_policy_name),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "enum": [*POLICIES, AUTO]},
                *(_pair_schema(p.variable_dtype, p.compute_dtype) for p in POLICIES.values()),
            ]
        }
    ),
]


class ProbeSpec(StrictModel):
    """How policy 'auto' chooses. Before the job trains, each candidate (float32,
    mixed_bfloat16, mixed_float16) runs warmup + steps steps from the same initial weights on
    the same batches; the job then trains with the fastest candidate whose loss tracks
    float32's within loss_tolerance and whose lost_share stays at most max_lost_share (a mixed
    policy must also beat float32 by min_speedup). The probes are not in the step history."""

    steps: int = Field(
        default=20, ge=2, le=1000, description="Timed steps per candidate, after its warm-up."
    )
    warmup: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="Untimed steps per candidate first, so tracing and compilation do not "
        "count as its step time (its lost_share is measured on these).",
    )
    loss_tolerance: float = Field(
        default=0.05,
        gt=0,
        le=10,
        description="How far a candidate's mean probe loss may stray from float32's, as a "
        "fraction of float32's (0.05: within 5%).",
    )
    max_lost_share: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="The largest lost_share a candidate may show (its mean over the probe): "
        "the share of gradient elements nonzero in float32 but flushed to zero in its own "
        "precision.",
    )
    min_speedup: float = Field(
        default=1.05,
        ge=1,
        le=100,
        description="A mixed policy is chosen only if it runs at least this many times as fast "
        "as float32 (median step time); otherwise float32 is.",
    )


class PrecisionSpec(StrictModel):
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"graph_rewrite": {"const": True}}, "required": ["graph_rewrite"]},
            "then": {
                "required": ["policy"],
                "properties": {
                    "policy": {
                        "anyOf": [
                            {"const": "float32"},
                            {
                                "type": "object",
                                "properties": {
                                    "variable_dtype": {"const": "float32"},
                                    "compute_dtype": {"const": "float32"},
                                },
                            },
                        ]
                    }
                },
            },
        }
    )

    policy: PolicyField = Field(
        default="mixed_float16",
        description="A Keras dtype policy name, or {variable_dtype, compute_dtype} mapped to "
        "the name it means, or 'auto': probe "
        + ", ".join(AUTO_CANDIDATES)
        + " on this model before training and train with the one precision.probe picks.",
    )
    output_float32: bool = Field(
        default=True,
        description="Run the output activation in float32 (the TensorFlow guide's advice), so a "
        "float16 softmax cannot overflow.",
    )
    graph_rewrite: bool = Field(
        default=False,
        description="TensorFlow's grappler auto_mixed_precision rewrite (the TF 2 form of "
        "TF_ENABLE_AUTO_MIXED_PRECISION): auto_mixed_precision on GPU, "
        "auto_mixed_precision_onednn_bfloat16 on CPU. Needs policy 'float32'.",
    )
    probe: ProbeSpec = Field(
        default_factory=ProbeSpec,
        description="How policy 'auto' probes and chooses; other policies ignore it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_forms(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(str(k).upper() == LEGACY_AMP_ENV for k in data):
            raise PydanticCustomError("legacy_env_var", LEGACY_AMP_EXPLANATION)
        return data

    @model_validator(mode="after")
    def _rewrite_needs_float32(self) -> PrecisionSpec:
        if self.graph_rewrite and self.policy == AUTO:
            raise PydanticCustomError(
                "graph_rewrite_conflict",
                "precision.graph_rewrite cannot be combined with policy 'auto': 'auto' may "
                "pick a mixed policy, and the grappler rewrite needs a float32 graph (on a "
                "mixed one it would cast twice). Use policy 'float32' with graph_rewrite, or "
                "'auto' without it.",
            )
        if self.graph_rewrite and self.policy != "float32":
            raise PydanticCustomError(
                "graph_rewrite_conflict",
                "precision.graph_rewrite cannot be combined with the Keras policy "
                f"'{self.policy}': the grappler rewrite casts a float32 graph to 16-bit on its "
                "own, and on top of a Keras mixed policy it would cast twice and keep no "
                "float32 master weights it knows about. Use policy 'float32' with "
                "graph_rewrite, or a mixed policy without it.",
            )
        return self


# --------------------------------------------------------------------------------------------
# Loss scaling


class LossScaleSpec(StrictModel):
    # The legacy dynamic flag names a mode; JSON Schema can say which (see _consistent).
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"dynamic": {"const": flag}}, "required": ["dynamic"]},
                    "then": {"properties": {"mode": {"enum": ["auto", mode]}}},
                }
                for flag, mode in ((True, "dynamic"), (False, "fixed"))
            ]
        }
    )

    mode: Literal["auto", "dynamic", "fixed", "none"] = Field(
        default="auto",
        description="auto: dynamic for float16 compute, none otherwise. fixed: a constant "
        "scale that still skips non-finite updates (the old dynamic=False).",
    )
    initial_scale: float = Field(default=2.0**15, ge=2.0**-24, le=2.0**64)
    growth_steps: int = Field(
        default=2000, ge=1, le=10**9, description="Finite steps in a row before growing."
    )
    growth_factor: float = Field(default=2.0, gt=1, le=2.0**16)
    backoff_factor: float = Field(default=0.5, gt=0, lt=1)
    # The scale is a float32: keep it a normal float32 number (>= 2**-24 is plenty).
    min_scale: float = Field(default=1.0, ge=2.0**-24, le=2.0**64)
    max_scale: float = Field(default=2.0**24, ge=2.0**-24, le=2.0**64)
    hysteresis: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="Overflows tolerated before backing off; refilled when the scale grows.",
    )
    dynamic: bool | None = Field(
        default=None,
        description="The old LossScaleOptimizer(dynamic=...) argument: true means mode "
        "'dynamic', false means mode 'fixed'.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LossScaleSpec:
        if self.dynamic is not None:
            wanted = "dynamic" if self.dynamic else "fixed"
            if self.mode not in ("auto", wanted):
                raise PydanticCustomError(
                    "conflicting_mode",
                    f"dynamic={str(self.dynamic).lower()} means mode '{wanted}', but mode is "
                    f"'{self.mode}'",
                )
        if self.min_scale > self.max_scale:
            raise PydanticCustomError("scale_bounds", "min_scale must not exceed max_scale")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise PydanticCustomError(
                "scale_bounds",
                f"initial_scale {self.initial_scale:g} must lie within [min_scale, max_scale] = "
                f"[{self.min_scale:g}, {self.max_scale:g}]",
            )
        return self
