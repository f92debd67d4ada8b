"""The spec's guards, checked on the host against each drained batch of step records."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from workers.recording import Drained


class Guards:
    """The spec's guards, checked on each drained batch of records on the host."""

    def __init__(self, guards: dict[str, Any], min_scale: float | None) -> None:
        self.cfg = guards
        # The recorded scale is the float32 the scaler clamps to, so compare with that: a
        # floor such as 0.3 is 0.30000001 in float32, and a float64 comparison would never
        # see the scale reach it.
        self.min_scale = None if min_scale is None else float(np.float32(min_scale))
        self.nonfinite_run = 0
        self.min_scale_run = 0
        self.window: deque[bool] = deque(maxlen=guards["overflow_window"])
        self.warning: str | None = None

    def state(self) -> dict[str, Any]:
        return {
            "nonfinite_run": self.nonfinite_run,
            "min_scale_run": self.min_scale_run,
            "warning": self.warning,
        }

    def restore(self, state: dict[str, Any], window: list[bool]) -> None:
        self.nonfinite_run = int(state["nonfinite_run"])
        self.min_scale_run = int(state["min_scale_run"])
        self.warning = state["warning"]
        self.window.extend(window)

    def check(self, first: int, d: Drained) -> str | None:
        """A reason to fail the job, or None."""
        if self._all_clear(d):
            # The usual drain, in bulk: every run is broken and nothing can trip.
            self.nonfinite_run = self.min_scale_run = 0
            self.window.extend([False] * len(d))
        else:
            reason = self._check_each(first, d)
            if reason is not None:
                return reason
        self._update_warning()
        return None

    def _all_clear(self, d: Drained) -> bool:
        return (
            len(d) > 0
            and bool(d.finite.all())
            and bool(np.isfinite(d.loss).all())
            and (self.min_scale is None or bool((d.scale > self.min_scale).all()))
        )

    def _check_each(self, first: int, d: Drained) -> str | None:
        cfg = self.cfg
        for i in range(len(d)):
            step, finite = first + i, bool(d.finite[i])
            loss, scale = float(d.loss[i]), float(d.scale[i])
            self.window.append(not finite)
            self.nonfinite_run = 0 if finite else self.nonfinite_run + 1
            limit = cfg["max_consecutive_nonfinite"]
            if limit is not None and self.nonfinite_run >= limit:
                return (
                    f"guard: {self.nonfinite_run} steps in a row had non-finite gradients "
                    f"(updates skipped) up to step {step}; the loss scale is {scale:g}. "
                    "Loss scaling cannot recover this run: lower the learning rate or check "
                    "the data and model for NaNs."
                )
            if cfg["fail_on_nonfinite_loss"] and finite and not math.isfinite(loss):
                return (
                    f"guard: the loss was {loss} at step {step} although every gradient was "
                    "finite, so loss scaling is not the cause: the model diverged."
                )
            if self.min_scale is not None and scale <= self.min_scale:
                self.min_scale_run += 1
                limit = cfg["max_steps_at_min_scale"]
                if limit is not None and self.min_scale_run >= limit:
                    return (
                        f"guard: the loss scale sat at its floor min_scale={self.min_scale:g} "
                        f"for {self.min_scale_run} steps (up to step {step}): gradients keep "
                        "overflowing even unscaled. Consider mixed_bfloat16 or a lower "
                        "learning rate."
                    )
            else:
                self.min_scale_run = 0
        return None

    def _update_warning(self) -> None:
        threshold = self.cfg.get("overflow_warn_rate")
        if threshold is None:
            self.warning = None
        elif len(self.window) >= min(self.window.maxlen or 1, 10):
            rate = sum(self.window) / len(self.window)
            if rate > threshold:
                self.warning = (
                    f"overflow rate {rate:.1%} over the last {len(self.window)} steps "
                    f"(warn above {threshold:.1%})"
                )
            else:
                self.warning = None
