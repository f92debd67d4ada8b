"""What a gradient sample's raw counts mean: the figures users read (``zero_share``,
``headroom``, ``underflow_share``...), computed on the host from the counts the in-graph meter
(``workers.gradients``) wrote. Plain numpy, so these rules are tested without TensorFlow.

Every figure is of ``G``, the gradient of the *scaled* loss as the optimizer received it, and
``S``, the loss scale that step used (1 when not scaling). The shadow's ``g32`` is the same
batch's gradient with the same weights in float32 compute, unscaled.
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np

from workers.protocol import Sample

# float16's largest finite value, its smallest normal and its smallest subnormal.
FLOAT16_MAX = 65504.0
FLOAT16_MIN_NORMAL = 2.0**-14
FLOAT16_MIN_SUBNORMAL = 2.0**-24
LOG2_FLOAT16_MAX = math.log2(FLOAT16_MAX)

# The columns of one variable's row in the meter's buffer.
ZEROS, SIZE, MAX, MIN_NONZERO, SUBNORMAL, FINITE = 0, 1, 2, 3, 4, 5
REF_NONZERO, UNDERFLOW, LOST, ERR_SQ, REF_SQ = 6, 7, 8, 9, 10
WIDTH = 11


def _share(part: float, whole: float) -> float | None:
    return float(part / whole) if whole > 0 else None


def _log2(value: float) -> float | None:
    return float(math.log2(value)) if 0 < value < math.inf else None


def figures(row: np.ndarray, shadow: bool) -> dict[str, Any]:
    """One variable's (or, summed as ``combine`` does, the model's) figures from its counts.
    None where a figure is undefined: no nonzero element, a non-finite gradient, no shadow."""
    finite = bool(row[FINITE] > 0.5)
    nonzero = row[SIZE] - row[ZEROS]
    log2_max = _log2(float(row[MAX])) if finite else None
    out: dict[str, Any] = {
        "finite": finite,
        "zero_share": _share(row[ZEROS], row[SIZE]),
        "log2_max": log2_max,
        "log2_min_nonzero": _log2(float(row[MIN_NONZERO])) if nonzero > 0 else None,
        "headroom": LOG2_FLOAT16_MAX - log2_max if log2_max is not None else None,
        "subnormal_share": _share(row[SUBNORMAL], nonzero) if finite else None,
        "underflow_share": None,
        "lost_share": None,
        "relative_error": None,
    }
    if shadow:
        out["underflow_share"] = _share(row[UNDERFLOW], row[REF_NONZERO])
        out["lost_share"] = _share(row[LOST], row[REF_NONZERO])
        if finite and row[REF_SQ] > 0:
            out["relative_error"] = float(math.sqrt(row[ERR_SQ] / row[REF_SQ]))
    return out


def combine(rows: np.ndarray) -> np.ndarray:
    """The whole model's counts from its variables' rows: counts and squares add up, the
    largest is the largest, the smallest nonzero the smallest, finite only if all are."""
    total: np.ndarray = rows.sum(axis=0)
    total[MAX] = rows[:, MAX].max() if len(rows) else 0.0
    total[MIN_NONZERO] = rows[:, MIN_NONZERO].min() if len(rows) else math.inf
    total[FINITE] = float(bool((rows[:, FINITE] > 0.5).all()))
    return total


def sample(step: int, scale: float, shadow: bool, names: list[str], rows: np.ndarray) -> Sample:
    """The message's sample: the model's figures at top level, each variable's in
    ``variables``."""
    out = {
        "step": int(step),
        "loss_scale": float(scale),
        "shadow": bool(shadow),
        **figures(combine(rows), shadow),
        "variables": [
            {"name": name, **figures(row, shadow)} for name, row in zip(names, rows, strict=True)
        ],
    }
    return cast(Sample, out)
