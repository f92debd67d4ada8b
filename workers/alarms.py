"""Alarms that explain: the job's gradient samples, read as they arrive, warn (or, with
``gradients.guard``, fail the job) when the loss scale is not doing its work. Host side,
plain Python: each alarm says which layers and what to try.

- **underflow**: on a float16-compute job, the shadow's ``underflow_share`` or ``lost_share``
  (any job: ``lost_share``) above ``alarm_share`` for ``alarm_samples`` shadow samples in a
  row;
- **headroom**: the largest scaled gradient within one doubling of float16's largest value for
  ``alarm_samples`` samples in a row, on a float16 job whose scale does not adapt (a dynamic
  scale grows until it overflows by design, and backs off);
- **floor**: the dynamic scale at ``min_scale`` for ``alarm_samples`` samples in a row.

Each alarm fires once per attempt: a warning is a call to act, not a log line per sample.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from workers.cpu import compute_16bit
from workers.protocol import Sample

WORST_LAYERS = 3


def _worst(sample: dict[str, Any], key: str) -> str:
    ranked = sorted(
        (v for v in sample["variables"] if (v.get(key) or 0) > 0),
        key=lambda v: -float(v[key]),
    )[:WORST_LAYERS]
    return ", ".join(f"{v['name']} ({v[key]:.0%})" for v in ranked) or "none in particular"


class GradientAlarms:
    def __init__(self, spec: dict[str, Any]) -> None:
        cfg = spec.get("gradients") or {}
        self.share: float | None = cfg.get("alarm_share")
        self.needed = int(cfg.get("alarm_samples", 3))
        self.guard = bool(cfg.get("guard", False))
        self.float16 = compute_16bit(spec["precision"]["policy"]) == "float16"
        ls = spec["loss_scale"]
        self.mode: str = ls["mode"]
        # The recorded scale is a float32: compare with the floor as the scaler clamps to it.
        self.min_scale = float(np.float32(ls["min_scale"]))
        self.runs = {"underflow": 0, "headroom": 0, "floor": 0}
        self.fired: set[str] = set()

    def check(self, sample: Sample) -> tuple[list[str], str | None]:
        """The warnings this sample raises, and a reason to fail the job (the guard)."""
        warnings: list[str] = []
        failure: str | None = None
        for kind, hit, message in self._conditions(cast(dict[str, Any], sample)):
            if hit is None:
                continue  # this sample says nothing about it (no shadow, say)
            self.runs[kind] = self.runs[kind] + 1 if hit else 0
            if self.runs[kind] >= self.needed and kind not in self.fired:
                self.fired.add(kind)
                warnings.append(message)
                if self.guard and failure is None:
                    failure = f"guard (gradients.guard): {message}"
        return warnings, failure

    def _conditions(self, s: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
        out: list[tuple[str, bool | None, str]] = []
        step, scale, n = s["step"], s["loss_scale"], self.needed
        if self.share is not None and s["shadow"]:
            under = (s.get("underflow_share") or 0.0) if self.float16 else 0.0
            lost = s.get("lost_share") or 0.0
            key = "lost_share" if lost >= under else "underflow_share"
            what = "were lost" if key == "lost_share" else "flush to zero in float16"
            out.append(
                (
                    "underflow",
                    max(under, lost) > self.share,
                    f"gradient underflow: up to step {step}, {max(under, lost):.0%} of the "
                    f"gradient elements {what} "
                    f"at loss scale {scale:g} ({n} shadow samples in a row above "
                    f"{self.share:.0%}); worst layers: {_worst(s, key)}. Try a larger "
                    "loss_scale.initial_scale (or mode 'dynamic'), or precision.policy "
                    "'mixed_bfloat16', which has float32's range.",
                )
            )
        if self.float16 and self.mode != "dynamic" and s["finite"]:
            headroom = s.get("headroom")
            out.append(
                (
                    "headroom",
                    None if headroom is None else headroom < 1.0,
                    f"no headroom: up to step {step} the largest scaled gradient came within "
                    f"one doubling of float16's largest value 65504 at loss scale {scale:g} "
                    f"({n} samples in a row); layers nearest: {_worst_headroom(s)}. Lower "
                    "loss_scale.initial_scale or use mode 'dynamic', which backs off.",
                )
            )
        if self.mode == "dynamic":
            out.append(
                (
                    "floor",
                    scale <= self.min_scale,
                    f"the loss scale sits at its floor min_scale={self.min_scale:g} (up to "
                    f"step {step}, {n} samples in a row): gradients overflow even at that "
                    "scale, and small ones flush to zero. Lower the learning rate, or use "
                    "precision.policy 'mixed_bfloat16'.",
                )
            )
        return out


def _worst_headroom(sample: dict[str, Any]) -> str:
    ranked = sorted(
        (v for v in sample["variables"] if v.get("headroom") is not None),
        key=lambda v: float(v["headroom"]),
    )[:WORST_LAYERS]
    return ", ".join(f"{v['name']} ({v['headroom']:.1f})" for v in ranked) or "none"
