"""``precision: {policy: "auto"}``: choose the policy from the model's own numbers.

Before training, the child probes each candidate (float32, mixed_bfloat16, mixed_float16):
the same model from the same initial weights (the job's seed) on the same first batches,
``probe.warmup`` steps with the gradient meter and its float32 shadow on every step, then
``probe.steps`` timed steps with the meter off. ``decide`` then applies the rule:

1. float32 is the reference and always eligible.
2. A mixed candidate is eligible when its loss is finite, its mean loss over the timed steps
   is within ``loss_tolerance`` (relative) of float32's, and the mean share of gradient
   elements it lost (``lost_share``, from the shadow) is at most ``max_lost_share``.
3. The fastest eligible candidate (median step time) wins, but a mixed policy must run at
   least ``min_speedup`` times float32's speed: otherwise float32 is kept.

The probes are not part of the job's step history: nothing they do is sent but the decision.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras

from service.specs.policies import AUTO_CANDIDATES, POLICIES, loss_scale_mode_for
from workers.context import RunContext
from workers.protocol import Sample

if TYPE_CHECKING:  # the trainer's module calls this one: no import back at run time
    from workers.trainer import Plan

# The probe's settings are always in the normalized spec (precision.probe).
CANDIDATES = AUTO_CANDIDATES
FIELDS = (
    "policy",
    "median_step_seconds",
    "mean_loss",
    "loss_gap",
    "overflow_steps",
    "steps",
    "underflow_share",
    "lost_share",
    "eligible",
    "why",
)
PROBE_EXECUTION = 4  # steps per execution while probing: several timings out of few steps
ROUNDS = 4  # the timed steps' rounds (see choose)


def with_policy(spec: dict[str, Any], policy: str) -> dict[str, Any]:
    """The spec as it trains under ``policy``: its loss-scale mode resolved for that policy's
    compute dtype (normalization left 'auto' for the child to resolve)."""
    out = copy.deepcopy(spec)
    out["precision"]["policy"] = policy
    ls = out["loss_scale"]
    ls["mode"] = loss_scale_mode_for(ls["mode"], POLICIES[policy].compute_dtype)
    return out


class _Timer(keras.callbacks.Callback):  # type: ignore[misc]
    """Per execution: the seconds per step, the step records and the gradient samples,
    drained as the job's own stream drains them (so the probe pays what the run pays)."""

    def __init__(self, plan: Plan) -> None:
        super().__init__()
        self.plan = plan
        self.started = 0.0
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.finite: list[bool] = []
        self.samples: list[Sample] = []

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        built = self.plan.built
        d = built.recorder.drain()
        if len(d):
            self.seconds.append((time.perf_counter() - self.started) / len(d))
        self.losses += d.loss.tolist()
        self.finite += d.finite.tolist()
        meter = built.trainer.meter
        if meter is not None:
            self.samples += meter.drain()


@dataclasses.dataclass
class _Candidate:
    policy: str
    plan: Plan
    timer: _Timer
    done: int = 0  # probe steps trained so far


def _warm(
    ctx: RunContext, policy: str, plan_for: Callable[[RunContext], Plan], warmup: int
) -> _Candidate:
    """Build ``policy``'s model from the job's seed and train its warm-up steps with the
    meter and the shadow on every step."""
    spec = with_policy(ctx.spec, policy)
    spec["training"]["steps_per_execution"] = PROBE_EXECUTION
    spec["gradients"] = {**(spec.get("gradients") or {}), "every": 1, "shadow_every": 1}
    spec["faults"] = {**spec["faults"], "nonfinite_at_steps": []}  # rehearsals are the run's
    keras.utils.set_random_seed(spec["training"]["seed"])
    # Whatever the plan would tell the job (a code job's notes) stays inside the probe.
    quiet = dataclasses.replace(ctx, spec=spec, emit=lambda message: None, resume_step=None)
    plan = plan_for(quiet)
    candidate = _Candidate(policy, plan, _Timer(plan))
    _fit(candidate, warmup)
    meter = plan.built.trainer.meter
    if meter is not None:
        meter.active = False  # the timed steps pay nothing for the meter
    candidate.timer.seconds.clear()
    return candidate


def _figures(c: _Candidate, warmup: int) -> dict[str, Any]:
    timer = c.timer
    timed = [x for x in timer.losses[warmup:] if math.isfinite(x)]
    shadows = [s for s in timer.samples if s["shadow"]]
    return {
        "policy": c.policy,
        "median_step_seconds": statistics.median(timer.seconds) if timer.seconds else None,
        "mean_loss": statistics.fmean(timed) if timed else None,
        "loss_gap": None,
        "overflow_steps": sum(1 for f in timer.finite if not f),
        "steps": len(timer.finite),
        "underflow_share": _mean(s.get("underflow_share") for s in shadows),
        "lost_share": _mean(s.get("lost_share") for s in shadows),
        "eligible": False,
        "why": "",
    }


def _fit(c: _Candidate, count: int) -> None:
    """Train ``count`` more probe steps, across epochs when one is shorter."""
    plan, end = c.plan, c.done + count
    while c.done < end:
        epoch, skip = divmod(c.done, plan.per_epoch)
        n = min(end - c.done, plan.per_epoch - skip)
        plan.built.trainer.fit(
            plan.epoch_data(epoch, skip),
            epochs=1,
            steps_per_epoch=n,
            verbose=0,
            shuffle=False,
            callbacks=[c.timer],
        )
        c.done += n


def _mean(values: Any) -> float | None:
    present = [float(v) for v in values if v is not None]
    return statistics.fmean(present) if present else None


def decide(probes: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Apply the rule to the probes (filled in place with ``loss_gap``, ``eligible``, ``why``)
    and say which policy trains, and why."""
    ref = next(p for p in probes if p["policy"] == "float32")
    ref["eligible"], ref["why"] = True, "the reference"
    ref["loss_gap"] = 0.0 if ref["mean_loss"] is not None else None
    for p in probes:
        if p is ref or p.get("why"):  # the reference, or a probe that failed (it says why)
            continue
        p["eligible"], p["why"] = _judge(p, ref, cfg)
    timed = [p for p in probes if p["eligible"] and p["median_step_seconds"]]
    fastest = min(timed, key=lambda p: p["median_step_seconds"], default=ref)
    others = "; ".join(f"{p['policy']}: {p['why']}" for p in probes if not p["eligible"])
    if fastest is ref:
        reason = "float32 was the fastest of the candidates that track it"
    else:
        speedup = ref["median_step_seconds"] / fastest["median_step_seconds"]
        if speedup < float(cfg["min_speedup"]):
            fastest = ref
            reason = (
                f"the fastest candidate that tracks float32 ran only {speedup:.2f}x "
                f"float32's speed (a mixed policy needs {cfg['min_speedup']:g}x), so float32"
            )
        else:
            reason = f"{fastest['policy']} ran {speedup:.2f}x float32's speed and tracks it"
    if others:
        reason += f". Not eligible: {others}"
    return {"policy": fastest["policy"], "reason": reason, "probes": probes}


def _judge(p: dict[str, Any], ref: dict[str, Any], cfg: dict[str, Any]) -> tuple[bool, str]:
    if p["mean_loss"] is None:
        return False, "its loss was never finite"
    if ref["mean_loss"] is not None:
        scale = max(abs(ref["mean_loss"]), 1e-30)
        p["loss_gap"] = abs(p["mean_loss"] - ref["mean_loss"]) / scale
    lost = p["lost_share"] or 0.0
    if lost > float(cfg["max_lost_share"]):
        return False, (
            f"lost {lost:.1%} of its gradient elements to underflow "
            f"(max_lost_share {float(cfg['max_lost_share']):.1%})"
        )
    if p["loss_gap"] is not None and p["loss_gap"] > float(cfg["loss_tolerance"]):
        return False, (
            f"its loss differed from float32's by {p['loss_gap']:.1%} "
            f"(loss_tolerance {float(cfg['loss_tolerance']):.1%})"
        )
    return True, "tracks float32"


def choose(ctx: RunContext, plan_for: Callable[[RunContext], Plan]) -> dict[str, Any]:
    """Probe every candidate and decide. The timed steps run in rounds, one candidate after
    the other, so a machine that slows down mid-probe slows all of them alike. A candidate
    that fails (an op without a kernel for its dtype, say) is not eligible; float32 failing
    is the job's own failure."""
    cfg = ctx.spec["precision"]["probe"]
    warmup, steps = int(cfg["warmup"]), int(cfg["steps"])
    warm: list[_Candidate] = []
    failed: dict[str, str] = {}
    for policy in CANDIDATES:
        try:
            warm.append(_warm(ctx, policy, plan_for, warmup))
        except Exception as exc:
            if policy == "float32":
                raise
            failed[policy] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    rounds = max(1, min(ROUNDS, steps // PROBE_EXECUTION))
    for r in range(rounds):
        share = steps // rounds + (1 if r < steps % rounds else 0)
        for c in list(warm):
            try:
                _fit(c, share)
            except Exception as exc:
                if c.policy == "float32":
                    raise
                warm.remove(c)
                failed[c.policy] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    probes = []
    for policy in CANDIDATES:
        probed = next((c for c in warm if c.policy == policy), None)
        if probed is not None:
            probes.append(_figures(probed, warmup))
        else:
            probe = dict.fromkeys(FIELDS, None)
            probe.update(policy=policy, steps=0, overflow_steps=0, eligible=False)
            probe["why"] = f"failed: {failed[policy]}"
            probes.append(probe)
    del warm
    keras.backend.clear_session()
    return decide(probes, cfg)
