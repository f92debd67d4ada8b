"""Fake trainers for supervisor tests: real spawned processes that speak the child protocol
without TensorFlow. Module-level functions, so ``spawn`` can import them in the child.

Each reads what to do from ``spec["fake"]`` (the supervisor passes the spec through as is).

Gradient samples, the precision decision and alarms (issue #24), in ``spec["fake"]`` for the
``succeed`` and ``slow`` modes, and in each attempt of a ``plan`` (``plan[attempt - 1]``);
none of them is on by default, so every other fake behaves as before:

- ``gradients_every: N``: after each batch of steps, a ``gradients`` message with a sample
  (``fake_sample``) of every step ``s`` of the batch with ``s % N == 0``, two variables each
  (``dense/kernel``, ``dense/bias``); figures depend on the attempt, so a test can tell which
  attempt wrote a sample.
- ``shadow_every: M``: the samples of steps with ``s % M == 0`` are shadow samples (their
  ``underflow_share``, ``lost_share`` and ``relative_error`` are set).
- ``decision: true`` (``DECISION``) or a decision object: sent before ``started``, as the auto
  policy's child does, when the payload carries no ``precision_decision``; when it carries
  one, the fake instead sends the note ``decision_note(policy)`` ("trained with the stored
  precision decision: ...") and does not decide again.
- ``alarm_at: step`` (with ``alarm_message``, default ``alarm_text(step)``): an ``alarm``
  message after the batch holding that step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

VARIABLES = ("dense/kernel", "dense/bias")
DECISION: dict[str, Any] = {
    "policy": "mixed_float16",
    "reason": "fake: the fastest candidate whose loss tracks float32's",
    "probes": [
        {
            "policy": policy,
            "median_step_seconds": seconds,
            "mean_loss": 0.5,
            "loss_gap": gap,
            "overflow_steps": 0,
            "steps": 20,
            "underflow_share": 0.0,
            "lost_share": 0.0,
            "eligible": True,
            "why": "within tolerance",
        }
        for policy, seconds, gap in (
            ("float32", 0.004, 0.0),
            ("mixed_bfloat16", 0.003, 0.01),
            ("mixed_float16", 0.002, 0.001),
        )
    ],
}


def decision_note(policy: str) -> str:
    return f"trained with the stored precision decision: {policy}"


def alarm_text(step: int) -> str:
    return f"fake alarm: gradient underflow up to step {step}; try a larger initial_scale"


def fake_sample(
    step: int, *, attempt: int = 1, scale: float = 1024.0, shadow: bool = False, finite: bool = True
) -> dict[str, Any]:
    """The sample the fake sends for ``step`` (figures exact in binary, so they round-trip
    through both databases and JSON unchanged)."""
    log2_max = None if not finite else -2.0 - (step % 5)

    def figures(zero_share: float, offset: float) -> dict[str, Any]:
        top = None if log2_max is None else log2_max - offset
        return {
            "finite": finite,
            "zero_share": zero_share,
            "log2_max": top,
            "log2_min_nonzero": -30.0 + (step % 3) - offset,
            "headroom": None if top is None else 15.75 - top,
            "subnormal_share": 0.125,
            "underflow_share": 0.03125 * attempt if shadow else None,
            "lost_share": 0.015625 * attempt if shadow else None,
            "relative_error": 0.0009765625 * attempt if shadow else None,
        }

    return {
        "step": step,
        "loss_scale": scale,
        "shadow": shadow,
        **figures(0.0078125 * attempt, 0.0),
        "variables": [
            {"name": name, **figures(0.25 * i, float(i))} for i, name in enumerate(VARIABLES)
        ],
    }


class Meter:
    """What a fake attempt sends besides its steps: the decision first, then gradient
    samples and an alarm as the batches go out (see the module's doc)."""

    def __init__(self, options: dict[str, Any], payload: dict[str, Any]) -> None:
        self.every = int(options.get("gradients_every", 0))
        self.shadow_every = int(options.get("shadow_every", 0))
        self.decision = options.get("decision")
        self.alarm_at = options.get("alarm_at")
        self.alarm_message = options.get("alarm_message")
        self.attempt = int(payload.get("attempt") or 1)
        self.stored = payload.get("precision_decision")

    def decide(self, conn: Connection) -> None:
        if not self.decision:
            return
        if self.stored is not None:
            conn.send({"type": "note", "message": decision_note(self.stored["policy"])})
            return
        decision = DECISION if self.decision is True else self.decision
        conn.send({"type": "decision", "decision": decision})

    def after(
        self,
        conn: Connection,
        steps: range,
        scale: float = 1024.0,
        overflow: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        if self.every > 0:
            samples = [
                fake_sample(
                    s,
                    attempt=self.attempt,
                    scale=scale,
                    shadow=self.shadow_every > 0 and s % self.shadow_every == 0,
                    finite=s not in overflow,
                )
                for s in steps
                if s % self.every == 0
            ]
            if samples:
                conn.send({"type": "gradients", "samples": samples})
        if self.alarm_at is not None and self.alarm_at in steps:
            message = self.alarm_message or alarm_text(self.alarm_at)
            conn.send({"type": "alarm", "message": message})


def _records(
    start: int, count: int, scale: float = 1024.0
) -> list[tuple[int, int, float, float, bool]]:
    return [(s, 0, 1.0 / (s + 1), scale, True) for s in range(start, start + count)]


def _started(
    conn: Connection, total: int, start: int = 0, device: dict[str, Any] | None = None
) -> None:
    conn.send(
        {
            "type": "started",
            "total_steps": total,
            "steps_per_epoch": total,
            "start_step": start,
            "steps_per_execution": 1,
            "precision_report": [],
            "device": device or {},
        }
    )


def _write_checkpoint(payload: dict[str, Any], step: int) -> None:
    """What the real child writes before it says "checkpoint": a file in its folder, which the
    supervisor commits to the store (and stages again for a resumed attempt)."""
    path = Path(payload["job_dir"]) / f"checkpoint-{step:012d}.npz"
    path.write_bytes(f"fake checkpoint of step {step}".encode())


def _attempt_of_a_plan(payload: dict[str, Any], conn: Connection, plan: list[Any]) -> None:
    """One attempt of a job that crashes and resumes: ``plan[attempt - 1]`` says up to which
    step it trains (from the acknowledged checkpoint the supervisor hands it), where its
    gradients overflow, where it checkpoints, what file it waits for before going on (and
    what it checkpoints once the file is there), and how it ends (``crash``: SIGKILL;
    ``succeed``). Each attempt's losses differ, as a resumed run's do when its data order or
    dropout differs."""
    attempt = payload["attempt"]
    step_plan = plan[attempt - 1]
    start = payload["resume_step"] or 0
    total = int(step_plan.get("total", step_plan["until"]))
    meter = Meter(step_plan, payload)
    meter.decide(conn)
    _started(conn, total, start=start)
    overflow = set(step_plan.get("overflow_at", []))
    checkpoint = step_plan.get("checkpoint_at")
    batch = int(step_plan.get("batch", 10))
    for first in range(start, step_plan["until"], batch):
        last = min(first + batch, step_plan["until"])
        records = [
            # Losses exact in float32, as TensorFlow's are.
            (s, 0, attempt + (s % 97) / 64, 1024.0, s not in overflow)
            for s in range(first, last)
        ]
        conn.send({"type": "steps", "records": records, "steps_per_second": 100.0})
        meter.after(conn, range(first, last), overflow=overflow)
        if checkpoint is not None and first < checkpoint <= last:
            _write_checkpoint(payload, checkpoint)
            conn.send({"type": "checkpoint", "step": checkpoint})
    # A file the test makes in the worker's data directory (the child's only view of
    # the host besides its scratch).
    wait_for = step_plan.get("wait_for")
    while wait_for and not (Path(payload["data_dir"]) / wait_for).exists():
        time.sleep(0.02)
    if (late := step_plan.get("checkpoint_after_wait")) is not None:
        _write_checkpoint(payload, late)
        conn.send({"type": "checkpoint", "step": late})
    if step_plan.get("then") == "crash":
        time.sleep(0.5)  # the supervisor commits what was sent, as it would have by now
        os.kill(os.getpid(), signal.SIGKILL)
    conn.send({"type": "done", "status": "succeeded", "error": None, "retryable": False})


def plan_in_data_dir(payload: dict[str, Any], conn: Connection) -> None:
    """``_attempt_of_a_plan`` for jobs submitted through the API (whose specs cannot carry a
    ``fake`` section): the plan is ``fake-plan.json`` in the worker's data directory."""
    plan = json.loads((Path(payload["data_dir"]) / "fake-plan.json").read_text())
    _attempt_of_a_plan(payload, conn, plan)


def trainer(payload: dict[str, Any], conn: Connection) -> None:
    fake = payload["spec"].get("fake", {})
    mode = fake.get("mode", "succeed")
    if mode == "plan":
        _attempt_of_a_plan(payload, conn, fake["plan"])
        return
    steps = int(fake.get("steps", 10))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if mode == "ignore_sigterm":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    meter = Meter(fake, payload)
    meter.decide(conn)
    _started(
        conn,
        steps,
        device={"warnings": fake.get("device_warnings", []), "gpu_ids": payload["gpu_ids"]},
    )
    if mode == "hang":
        time.sleep(3600)
    if mode == "exit_silently":
        conn.send({"type": "steps", "records": _records(0, 3), "steps_per_second": None})
        os._exit(3)
    if mode == "sigkill_self":
        conn.send({"type": "steps", "records": _records(0, 3), "steps_per_second": None})
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise":
        conn.send({"type": "steps", "records": _records(0, 2), "steps_per_second": None})
        conn.send(
            {"type": "done", "status": "failed", "error": "ValueError: boom", "retryable": True}
        )
        return
    if mode == "saves_link":
        # A "model" that is a link to a file of the server's: its host must not copy it.
        (Path(payload["job_dir"]) / "model.keras").symlink_to(fake["target"])
        conn.send({"type": "saved", "names": ["model.keras"]})
        conn.send({"type": "done", "status": "succeeded", "error": None, "retryable": False})
        return
    if mode == "job_error":
        conn.send({"type": "done", "status": "failed", "error": "bad data", "retryable": False})
        return
    if mode in ("slow", "ignore_sigterm"):
        # One step every `interval` seconds until told to stop (or forever, if deaf).
        interval = float(fake.get("interval", 0.05))
        step = 0
        while step < steps and not stop.is_set():
            conn.send({"type": "steps", "records": _records(step, 1), "steps_per_second": None})
            meter.after(conn, range(step, step + 1))
            step += 1
            time.sleep(interval)
        if stop.is_set():
            conn.send({"type": "done", "status": "cancelled", "error": None, "retryable": False})
            return
        conn.send({"type": "done", "status": "succeeded", "error": None, "retryable": False})
        return
    # succeed: send the steps in a few batches.
    batch = int(fake.get("batch", 4))
    for first in range(0, steps, batch):
        conn.send(
            {
                "type": "steps",
                "records": _records(first, min(batch, steps - first)),
                "steps_per_second": 100.0,
            }
        )
        meter.after(conn, range(first, min(first + batch, steps)))
    conn.send({"type": "metrics", "epoch": 0, "metrics": {"loss": 0.5}})
    if "timing" in fake:
        conn.send({"type": "metrics", "epoch": -1, "metrics": fake["timing"]})
    conn.send({"type": "done", "status": "succeeded", "error": None, "retryable": False})
