"""Static facts about Keras dtype policies, so the API can describe them without TensorFlow,
and the rules that depend only on them (what loss_scale.mode 'auto' means).

The table mirrors what ``keras.mixed_precision.Policy(name)`` reports in Keras 3;
``tests/test_training_keras.py`` checks it against real Keras.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dtype = Literal["float16", "bfloat16", "float32", "float64"]
PolicyName = Literal["float32", "float16", "bfloat16", "float64", "mixed_float16", "mixed_bfloat16"]
# What a spec may ask for: a policy, or "auto" (the job probes AUTO_CANDIDATES and picks one).
PolicyChoice = Literal[PolicyName, "auto"]
ScaleMode = Literal["dynamic", "fixed", "none"]

AUTO = "auto"
# float32 first: it is the reference the others' losses are compared with.
AUTO_CANDIDATES: tuple[PolicyName, ...] = ("float32", "mixed_bfloat16", "mixed_float16")


@dataclass(frozen=True)
class PolicyFacts:
    name: PolicyName
    variable_dtype: Dtype
    compute_dtype: Dtype
    loss_scaling_advised: bool
    note: str


POLICIES: dict[str, PolicyFacts] = {
    p.name: p
    for p in (
        PolicyFacts(
            "mixed_float16",
            "float32",
            "float16",
            True,
            "float16 compute, float32 variables: fast on Tensor Core GPUs (compute capability "
            ">= 7.0). float16's narrow exponent range makes small gradients underflow, so "
            "dynamic loss scaling is on by default.",
        ),
        PolicyFacts(
            "mixed_bfloat16",
            "float32",
            "bfloat16",
            False,
            "bfloat16 compute, float32 variables: float32's exponent range, so no loss scaling "
            "is needed. Fast on Ampere and newer GPUs (>= 8.0), TPUs and recent CPUs.",
        ),
        PolicyFacts("float32", "float32", "float32", False, "Full precision; the baseline."),
        PolicyFacts(
            "float16",
            "float16",
            "float16",
            True,
            "Variables in float16 too: small updates are lost to rounding. Prefer mixed_float16.",
        ),
        PolicyFacts(
            "bfloat16",
            "bfloat16",
            "bfloat16",
            False,
            "Variables in bfloat16: only 8 bits of mantissa for weights. Prefer mixed_bfloat16.",
        ),
        PolicyFacts("float64", "float64", "float64", False, "Double precision; slow on GPUs."),
    )
}

# The pairs Keras can express, and the name each one means.
_PAIRS: dict[tuple[str, str], PolicyName] = {
    (p.variable_dtype, p.compute_dtype): p.name for p in POLICIES.values()
}


class UnexpressiblePolicy(ValueError):
    """A variable/compute dtype pair that no Keras policy has."""


def policy_for_pair(variable_dtype: str, compute_dtype: str) -> PolicyName:
    """Map an explicit dtype pair to the Keras policy name that means it."""
    name = _PAIRS.get((variable_dtype, compute_dtype))
    if name is not None:
        return name
    if variable_dtype != "float32" and variable_dtype != compute_dtype:
        raise UnexpressiblePolicy(
            f"Keras has no policy with {variable_dtype} variables and {compute_dtype} compute: "
            "a policy either uses one dtype for both, or keeps float32 variables with a "
            "16-bit compute dtype (float32+float16 is 'mixed_float16', float32+bfloat16 is "
            "'mixed_bfloat16'). Keeping variables narrower than the compute dtype would lose "
            "every small update to rounding."
        )
    raise UnexpressiblePolicy(
        f"Keras has no policy with float32 variables and {compute_dtype} compute; "
        "the mixed policies are 'mixed_float16' and 'mixed_bfloat16'."
    )


def compute_dtype(name: str) -> str:
    return POLICIES[name].compute_dtype


_EXPLICIT_MODES: dict[str, ScaleMode] = {"dynamic": "dynamic", "fixed": "fixed", "none": "none"}


def loss_scale_mode_for(mode: str, compute_dtype: str) -> ScaleMode:
    """What loss_scale.mode means for a compute dtype: 'auto' is dynamic scaling for float16
    compute (its narrow exponent range underflows small gradients) and none otherwise; an
    explicit mode stays. The one place this rule lives: normalization applies it to a
    concrete policy, the training child to the policy 'auto' picked."""
    if mode == "auto":
        return "dynamic" if compute_dtype == "float16" else "none"
    if mode in _EXPLICIT_MODES:
        return _EXPLICIT_MODES[mode]
    raise ValueError(f"unknown loss_scale.mode {mode!r}")
