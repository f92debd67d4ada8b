"""StepStream: the Keras callback that drains the in-graph ring buffer once per execution, sends
the step records to the supervisor in batches, checks the guards, checkpoints, and measures
the run's timing and time to target."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any

import keras
import tensorflow as tf

from workers.alarms import GradientAlarms
from workers.checkpointer import Checkpointer, Progress
from workers.context import RunContext, disk_errors_explained
from workers.guards import Guards
from workers.protocol import Sample
from workers.recording import Drained, StepRecorder

TARGET_WINDOW = 50


WARMUP_EXECUTIONS = 2


class StepStream(keras.callbacks.Callback):  # type: ignore[misc]
    """Drains the recorder once per execution, checks guards and faults, sends records to the
    supervisor in batches, checkpoints, and stops training on SIGTERM."""

    def __init__(
        self,
        ctx: RunContext,
        recorder: StepRecorder,
        guards: Guards,
        checkpointer: Checkpointer,
        checkpoint_every: int,
        batch_size: int,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.recorder = recorder
        self.guards = guards
        self.checkpointer = checkpointer
        self.checkpoint_every = checkpoint_every
        self.batch_size = batch_size
        self.epoch = 0
        # Set by the trainer: a checkpoint due on an epoch's last step waits for on_epoch_end.
        self.steps_per_epoch: int | None = None
        self.checkpoint_at_epoch_end = False
        self.pending: list[tuple[int, int, float, float, bool]] = []
        self.last_flush = time.monotonic()
        self.last_checkpoint = recorder.drained_to
        self.failure: str | None = None
        self.stopped_by_signal = False
        self.sent_warning: str | None = None
        self.exec_started = 0.0
        self.executions = 0
        self.step_seconds: list[float] = []
        self.recent: deque[tuple[float, int]] = deque(maxlen=64)
        faults = ctx.spec["faults"]
        attempts = faults.get("crash_attempts")
        rehearsed = attempts is None or ctx.attempt in attempts
        self.crash_at = faults.get("crash_at_step") if rehearsed else None
        self.hang_at = faults.get("hang_at_step") if rehearsed else None
        self.target = ctx.spec["training"].get("target_loss")
        self.target_window: deque[float] = deque(maxlen=TARGET_WINDOW)
        self.reached: tuple[int, float] | None = None
        # Wall clock (seconds since the epoch), not perf_counter: it carries across attempts.
        self.first_started: float | None = None
        self.tensorboard: Any = None
        self.samples: list[Sample] = []
        self.alarms = GradientAlarms(ctx.spec)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.exec_started = time.perf_counter()
        if self.first_started is None:
            self.first_started = time.time()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        d = self.collect()
        if len(d):
            elapsed = time.perf_counter() - self.exec_started
            self.executions += 1
            if self.executions > WARMUP_EXECUTIONS:
                self.step_seconds.append(elapsed / len(d))
            self.recent.append((time.monotonic(), d.first + len(d)))
        self._faults(d)
        self._watch_target(d)
        forensics = getattr(self.model, "forensics", None)
        if forensics is not None:
            for report in forensics.drain():
                self.ctx.emit({"type": "forensics", "report": report})
        self._gradients()
        if self.failure is None:
            self.failure = self.guards.check(d.first, d)
        if self.failure is not None or self.ctx.stop.is_set():
            self.stopped_by_signal = self.ctx.stop.is_set()
            self.model.stop_training = True
        step = self.recorder.drained_to
        if step - self.last_checkpoint >= self.checkpoint_every:
            if self.steps_per_epoch and step % self.steps_per_epoch == 0:
                # The epoch ends here: its metrics (after validation) must reach the
                # supervisor before a checkpoint that resumes past the epoch.
                self.checkpoint_at_epoch_end = True
            else:
                self.checkpoint()
        if (
            time.monotonic() - self.last_flush >= self.ctx.flush_seconds
            or len(self.pending) > 20_000
        ):
            self.flush()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        metrics = {k: float(v) for k, v in (logs or {}).items() if _is_number(v)}
        self.flush()
        self.ctx.emit({"type": "metrics", "epoch": epoch, "metrics": metrics})
        if self.checkpoint_at_epoch_end:
            self.checkpoint_at_epoch_end = False
            self.checkpoint()

    def collect(self) -> Drained:
        d = self.recorder.drain()
        n = len(d)
        # tolist() converts a whole column in C: this runs once per execution on the
        # training thread, so per-element float() calls would be paid by every step.
        self.pending.extend(
            zip(
                range(d.first, d.first + n),
                [self.epoch] * n,
                d.loss.tolist(),
                d.scale.tolist(),
                d.finite.tolist(),
                strict=True,
            )
        )
        return d

    def _gradients(self) -> None:
        """The meter's samples since the last execution, read for alarms and sent with the
        next flush (so a checkpoint's message follows the samples it covers)."""
        meter = getattr(self.model, "meter", None)
        if meter is None:
            return
        for sample in meter.drain():
            self.samples.append(sample)
            warnings, failure = self.alarms.check(sample)
            for message in warnings:
                self.ctx.emit({"type": "alarm", "message": message})
            if failure is not None and self.failure is None:
                self.failure = failure

    def _faults(self, d: Drained) -> None:
        last = d.first + len(d) - 1
        if self.crash_at is not None and d.first <= self.crash_at <= last:
            self.flush()
            raise RuntimeError(f"injected crash at step {self.crash_at} (faults.crash_at_step)")
        if self.hang_at is not None and d.first <= self.hang_at <= last:
            self.flush()
            while True:  # a hung job: no progress, deaf to SIGTERM; the supervisor must kill it
                time.sleep(3600)

    def _watch_target(self, d: Drained) -> None:
        """The first step where the mean loss of the last TARGET_WINDOW steps reaches the
        spec's target_loss, and the wall time to it from the first execution's start (so
        compilation counts: it is part of what a precision costs). A resumed attempt goes on
        from the checkpoint's window and the first attempt's start."""
        if self.target is None or self.reached is not None or not len(d):
            return
        for i, loss in enumerate(d.loss.tolist()):
            if not math.isfinite(loss):
                continue
            self.target_window.append(loss)
            full = len(self.target_window) == self.target_window.maxlen
            if full and sum(self.target_window) / len(self.target_window) <= self.target:
                assert self.first_started is not None
                self.reached = (d.first + i, time.time() - self.first_started)
                return

    def steps_per_second(self) -> float | None:
        if len(self.recent) < 2:
            return None
        (t0, s0), (t1, s1) = self.recent[0], self.recent[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else None

    def flush(self) -> None:
        if self.guards.warning != self.sent_warning:
            self.sent_warning = self.guards.warning
            self.ctx.emit({"type": "warning", "message": self.guards.warning})
        if self.pending and self.tensorboard is not None:
            self._write_tensorboard()
        if self.pending:
            self.ctx.emit(
                {
                    "type": "steps",
                    "records": self.pending,
                    "steps_per_second": self.steps_per_second(),
                }
            )
            self.pending = []
        # After the rows: the supervisor may write what it holds between two messages, and a
        # sample stored without its step's row would outlive a crash past the history's end.
        if self.samples:
            self.ctx.emit({"type": "gradients", "samples": self.samples})
            self.samples = []
        self.last_flush = time.monotonic()

    def _write_tensorboard(self) -> None:
        with self.tensorboard.as_default():
            for step, _epoch, loss, scale, finite in self.pending:
                tf.summary.scalar("loss", loss, step=step)
                tf.summary.scalar("loss_scale", scale, step=step)
                tf.summary.scalar("finite", 1.0 if finite else 0.0, step=step)
        self.tensorboard.flush()

    def progress(self) -> Progress:
        counters = {
            "first_started": self.first_started,
            "target_window": list(self.target_window),
            "reached": None if self.reached is None else list(self.reached),
            "guards": self.guards.state(),
        }
        return Progress(counters, list(self.guards.window))

    def resume(self, progress: Progress) -> None:
        c = progress.counters
        self.first_started = c["first_started"]
        self.target_window.extend(c["target_window"])
        self.reached = None if c["reached"] is None else (int(c["reached"][0]), c["reached"][1])
        self.guards.restore(c["guards"], progress.guard_window)

    def checkpoint(self) -> None:
        step = self.recorder.drained_to
        self.flush()  # the rows a checkpoint covers reach the supervisor first
        with disk_errors_explained(self.checkpointer.directory):
            self.checkpointer.save(self.model, step, self.progress())
        self.last_checkpoint = step
        self.ctx.emit({"type": "checkpoint", "step": step})

    def timing(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.step_seconds:
            median = statistics.median(self.step_seconds)
            out["median_step_seconds"] = median
            out["examples_per_second"] = self.batch_size / median if median > 0 else 0.0
        if self.reached is not None:
            out["step_to_target"] = float(self.reached[0])
            out["time_to_target_seconds"] = self.reached[1]
        return out


def _is_number(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False
