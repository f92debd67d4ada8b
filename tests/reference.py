"""A plain-Python statement of the loss-scale rules, as docs/concepts.md's "Loss scaling" section
states them (with the default knobs: stock Keras 3 ``LossScaleOptimizer``; beyond them the
floor, cap and DeepSpeed-style hysteresis). It replays a sequence of finite/non-finite steps
and gives the scale each step must have used, to check recorded histories against. Written
from the rules, not from the scaler's code."""

from __future__ import annotations


def expected_scales(
    finite: list[bool],
    *,
    initial: float = 2.0**15,
    growth_steps: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    hysteresis: int = 1,
    dynamic: bool = True,
) -> list[float]:
    """The scale used at each step, given whether each step's gradients were finite."""
    scale, good, left = initial, 0, hysteresis
    used = []
    for ok in finite:
        used.append(scale)
        if not dynamic:
            continue
        if ok:
            good += 1
            if good == growth_steps:
                good, left = 0, hysteresis
                scale = min(scale * growth_factor, max_scale)
        else:
            good = 0
            left -= 1
            if left <= 0:
                scale = max(scale * backoff_factor, min_scale)
    return used
