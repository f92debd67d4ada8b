"""Fake trainers for supervisor tests: real spawned processes that speak the child protocol
without TensorFlow. Module-level functions, so ``spawn`` can import them in the child.

Each reads what to do from ``spec["fake"]`` (the supervisor passes the spec through as is)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


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
    conn.send({"type": "metrics", "epoch": 0, "metrics": {"loss": 0.5}})
    if "timing" in fake:
        conn.send({"type": "metrics", "epoch": -1, "metrics": fake["timing"]})
    conn.send({"type": "done", "status": "succeeded", "error": None, "retryable": False})
