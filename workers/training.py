"""One job's training, inside the training child. The only module tree that imports
TensorFlow (through ``workers.recording``, ``workers.scaler``, ``workers.builders``)."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from workers import data as data_mod
from workers.builders import build_model, build_optimizer, precision_report
from workers.checkpoints import checkpoint_path
from workers.cpu import CpuPrecision, cpu_warnings
from workers.losses import build_loss, spec_metrics
from workers.protocol import JobError, Message
from workers.recording import Drained, HalfwayTrainer, OverflowForensics, StepRecorder
from workers.scaler import HalfwayLossScaleOptimizer, make_scaler
from workers.staging import JobFiles

Emit = Callable[[Message], None]

DEFAULT_STEPS_PER_EXECUTION = 64
TARGET_WINDOW = 50
WARMUP_EXECUTIONS = 2


@dataclass
class RunContext:
    job_id: int
    spec: dict[str, Any]
    job_dir: Path
    data_dir: Path
    emit: Emit
    stop: threading.Event
    flush_seconds: float = 0.5
    gpu_ids: list[int] = field(default_factory=list)
    resume_step: int | None = None  # the checkpoint the supervisor acknowledged
    attempt: int = 1
    max_parameters: int | None = None  # the server's limit, for models sized only here
    code_dir: Path | None = None  # where code bundles are unpacked (code jobs)
    files: JobFiles | None = None  # how job_dir reaches the store; None: job_dir is the store


def configure_devices(ctx: RunContext) -> dict[str, Any]:
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        # Take memory as needed rather than all of it, so a job's footprint is its own.
        tf.config.experimental.set_memory_growth(gpu, True)
    info: dict[str, Any] = {"gpus": [g.name for g in gpus], "warnings": []}
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        cc = details.get("compute_capability")
        info.setdefault("compute_capability", []).append(cc)
        info.setdefault("device_names", []).append(details.get("device_name"))
    policy = ctx.spec["precision"]["policy"]
    info["warnings"] = hardware_warnings(
        policy, info.get("compute_capability", []), bool(ctx.spec["precision"]["graph_rewrite"])
    )
    replicas = int(ctx.spec.get("resources", {}).get("cpu_replicas", 1))
    if not gpus and replicas > 1:
        # Rehearse multi-device training on a CPU: split it into logical devices. This must
        # happen before TensorFlow creates its runtime, i.e. first thing in the child.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)]
        )
    return info


def make_strategy() -> tf.distribute.Strategy | None:
    """MirroredStrategy over the visible GPUs when there are several (the slot's GPUs), or
    over logical CPU devices when the job rehearses that; None for one device."""
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) > 1:
        return tf.distribute.MirroredStrategy([g.name for g in gpus])
    cpus = tf.config.list_logical_devices("CPU")
    if not gpus and len(cpus) > 1:
        return tf.distribute.MirroredStrategy([c.name for c in cpus])
    return None


def hardware_warnings(
    policy: str,
    capabilities: list[tuple[int, int] | None],
    graph_rewrite: bool = False,
    cpu: CpuPrecision | None = None,
) -> list[str]:
    """bfloat16 needs compute capability 8.0 and float16 Tensor Cores 7.0 to be fast; on a CPU,
    what the precision settings do depends on its instructions (workers/cpu.py)."""
    if not capabilities:
        return cpu_warnings(policy, graph_rewrite, cpu or CpuPrecision.detect())
    warnings: list[str] = []
    compute = {"mixed_float16": "float16", "float16": "float16"}.get(policy) or (
        "bfloat16" if "bfloat16" in policy else None
    )
    if compute is None:
        return warnings
    need = (8, 0) if compute == "bfloat16" else (7, 0)
    for i, cc in enumerate(capabilities):
        if cc is not None and tuple(cc) < need:
            warnings.append(
                f"GPU {i} has compute capability {cc[0]}.{cc[1]}; {compute} needs "
                f"{need[0]}.{need[1]} or newer to be fast, so {policy} may be slower than "
                "float32 here."
            )
    return warnings


def configure_graph_rewrite(enabled: bool) -> str | None:
    if not enabled:
        return None
    option = (
        "auto_mixed_precision"
        if tf.config.list_physical_devices("GPU")
        else "auto_mixed_precision_onednn_bfloat16"
    )
    tf.config.optimizer.set_experimental_options({option: True})
    return option


class Checkpointer:
    """The model's variables, optimizer state (the loss scaler's included) at a global step,
    one .npz per step (``checkpoint-<step>.npz``), each written atomically. The data position
    follows from the step, since every epoch has the same number of steps and its batch order
    is a function of (seed, epoch).

    The model's ``variables``, not just its ``weights``: they include the dropout layers'
    seed-generator states, without which a resumed job would replay the masks of step 0
    instead of continuing as the uninterrupted run does.

    One file per step because the child may checkpoint ahead of the history the supervisor
    has committed; a job resumes from the checkpoint the supervisor acknowledged (it commits
    that step together with the history before it), never from a newer one whose rows may
    have died with a killed supervisor. The supervisor deletes superseded files."""

    def __init__(self, directory: Path, files: JobFiles | None = None) -> None:
        self.directory = directory
        self.files = files or JobFiles.local(directory)

    def path(self, step: int) -> Path:
        return checkpoint_path(self.directory, step)

    def save(self, trainer: HalfwayTrainer, step: int, progress: Progress | None = None) -> None:
        arrays: dict[str, np.ndarray] = {}
        for i, w in enumerate(trainer.inner.variables):
            arrays[f"w{i}"] = np.asarray(w.numpy())
        for i, v in enumerate(trainer.optimizer.variables):
            arrays[f"o{i}"] = np.asarray(v.numpy())
        if progress is not None:
            arrays["progress"] = np.asarray(json.dumps(progress.counters))
            arrays["guard_window"] = np.asarray(progress.guard_window, dtype=bool)
        target = self.path(step)
        tmp = target.with_name(target.name + ".part")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        self.files.commit_checkpoint(step, target)

    def restore(self, trainer: HalfwayTrainer, step: int) -> Progress | None:
        """Load the checkpoint into the trainer; its progress (None in an older one)."""
        with np.load(self.path(step), allow_pickle=False) as f:
            model_vars, opt_vars = trainer.inner.variables, trainer.optimizer.variables
            if sum(k.startswith("w") for k in f.files) != len(model_vars) or sum(
                k.startswith("o") for k in f.files
            ) != len(opt_vars):
                raise JobError("the checkpoint does not match this job's model and optimizer")
            for i, w in enumerate(model_vars):
                w.assign(f[f"w{i}"])
            for i, v in enumerate(opt_vars):
                v.assign(f[f"o{i}"])
            if "progress" not in f.files:
                return None
            return Progress(json.loads(str(f["progress"])), f["guard_window"].tolist())


@dataclass
class Progress:
    """What a resumed attempt must continue rather than start again, besides the weights:
    the guards' runs, the target-loss window, the step and time the target was reached, and
    when the first attempt started training (so time to target spans attempts)."""

    counters: dict[str, Any]
    guard_window: list[bool]


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
        if self.failure is None:
            self.failure = self.guards.check(d.first, d)
        if self.failure is not None or self.ctx.stop.is_set():
            self.stopped_by_signal = self.ctx.stop.is_set()
            self.model.stop_training = True
        step = self.recorder.drained_to
        if step - self.last_checkpoint >= self.checkpoint_every:
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


@dataclass
class Built:
    """A job's Keras objects, as ``train`` wires them: ``model`` is the user's model (what
    gets saved), ``optimizer`` the inner optimizer, ``trainer`` the model that fits."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    scaler: HalfwayLossScaleOptimizer | None
    recorder: StepRecorder
    trainer: HalfwayTrainer


def build_trainer(
    spec: dict[str, Any],
    sample_shape: tuple[int, ...],
    num_classes: int,
    steps_per_execution: int,
    *,
    graph_rewrite: bool = False,
    strategy: tf.distribute.Strategy | None = None,
    max_parameters: int | None = None,
) -> Built:
    """The model, optimizer, scaler and recorder of a (normalized) spec, compiled and built
    (under ``strategy`` when given; the recorder stays outside it, see StepRecorder)."""
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        keras.config.set_dtype_policy(spec["precision"]["policy"])
        try:
            model = build_model(spec, sample_shape, num_classes, max_parameters)
        finally:
            keras.config.set_dtype_policy("float32")
    return compile_trainer(
        spec, model, steps_per_execution, graph_rewrite=graph_rewrite, strategy=strategy
    )


def compile_trainer(
    spec: dict[str, Any],
    model: keras.Model,
    steps_per_execution: int,
    *,
    optimizer: keras.optimizers.Optimizer | None = None,
    loss: Any = None,
    metrics: list[Any] | None = None,
    graph_rewrite: bool = False,
    strategy: tf.distribute.Strategy | None = None,
) -> Built:
    """Wrap a built model (a preset's or the user's) in Halfway's trainer: its optimizer in
    the loss scaler, the recorder, faults and forensics. ``optimizer``, ``loss`` and
    ``metrics`` default to the spec's."""
    recorder = StepRecorder(capacity=steps_per_execution)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        if optimizer is None:
            optimizer = build_optimizer(spec["optimizer"])
        scaler = make_scaler(optimizer, spec["loss_scale"])
        trainer = HalfwayTrainer(
            model,
            recorder,
            fault_steps=spec["faults"]["nonfinite_at_steps"],
            fault_variables=spec["faults"].get("nonfinite_variables"),
        )
        jit: bool | str = spec["training"].get("jit_compile", "auto")
        if graph_rewrite:
            jit = False  # XLA clusters bypass grappler, so the rewrite would not apply
        training = spec["training"]
        trainer.compile(
            optimizer=scaler or optimizer,
            loss=loss if loss is not None else build_loss(training.get("loss") or _SPARSE_CE),
            metrics=metrics if metrics is not None else spec_metrics(training),
            steps_per_execution=steps_per_execution,
            jit_compile=jit,
            auto_scale_loss=False,
        )
        # Build the optimizer (and the scaler's variables) now, not lazily inside the first
        # traced step: the train step reads the scale, and a checkpoint restores into them.
        trainer.optimizer.build(trainer.trainable_variables)
    # Outside the strategy, like the recorder: host-read variables the first replica writes.
    captures = int(spec.get("forensics", {}).get("captures", 1))
    trainer.forensics = OverflowForensics(trainer.trainable_variables, captures)
    return Built(model, optimizer, scaler, recorder, trainer)


_SPARSE_CE = {"name": "sparse_categorical_crossentropy"}


@dataclass
class Plan:
    """What a job trains: its wrapped model, the steps of an epoch, and each epoch's batches
    (``epoch_data(epoch, skip)`` leaves out the first ``skip`` batches, for a resume)."""

    built: Built
    per_epoch: int
    steps_per_execution: int
    epoch_data: Callable[[int, int], Any]
    validation: Any = None
    validation_batch_size: int | None = None
    callbacks: list[Any] = field(default_factory=list)
    save: Callable[[Path], list[str]] | None = None  # the files it wrote
    resume_note: Callable[[int, int], str | None] | None = None
    # Turns an exception raised in fit() into the job's own error (no retry), or None.
    blame: Callable[[Exception], Exception | None] | None = None
    batch_size: int | None = None  # examples per step, when not training.batch_size


def executions(
    training: dict[str, Any],
    per_epoch: int,
    strategy: tf.distribute.Strategy | None,
    device: dict[str, Any],
) -> int:
    """Steps per graph execution: the spec's, or as many as fit the ring buffer's default
    (capped by the epoch); one under MirroredStrategy."""
    spe: int = training.get("steps_per_execution") or min(DEFAULT_STEPS_PER_EXECUTION, per_epoch)
    if strategy is not None:
        device["replicas"] = strategy.num_replicas_in_sync
        if spe > 1:
            # Keras 3's multi-step loop cannot run a loss-scale optimizer's merge_call under
            # MirroredStrategy (it fails with an unfed placeholder, stock LossScaleOptimizer
            # included), so a distributed job runs one step per execution; every step is
            # still recorded, drained after each one.
            device["warnings"].append(
                f"steps_per_execution {spe} -> 1 under MirroredStrategy "
                f"({strategy.num_replicas_in_sync} replicas)"
            )
            spe = 1
    return spe


def train(ctx: RunContext) -> str:
    """Run the job to completion. Returns 'succeeded' or 'cancelled'; raises JobError (or any
    exception) on failure."""
    spec = ctx.spec
    training = spec["training"]
    ctx.job_dir.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(training["seed"])
    device = configure_devices(ctx)
    rewrite = configure_graph_rewrite(spec["precision"]["graph_rewrite"])
    if rewrite:
        device["graph_rewrite"] = rewrite
    strategy = make_strategy()
    if spec.get("code"):
        from workers.usercode import plan_code_job

        plan = plan_code_job(ctx, device, strategy, graph_rewrite=rewrite is not None)
    else:
        plan = _plan_arrays(ctx, device, strategy, graph_rewrite=rewrite is not None)
    return run_plan(ctx, plan, device)


def _plan_arrays(
    ctx: RunContext,
    device: dict[str, Any],
    strategy: tf.distribute.Strategy | None,
    *,
    graph_rewrite: bool,
) -> Plan:
    """A preset or Keras-config model on the spec's data, loaded into arrays: the batch
    order is Halfway's (a function of seed and epoch), so a resume is exact."""
    spec, training = ctx.spec, ctx.spec["training"]
    arrays = data_mod.load_arrays(spec["data"], training, ctx.data_dir)
    n_train = len(arrays.x_train)
    fixed_steps = training.get("steps_per_epoch")
    batch = training["batch_size"]
    per_epoch = data_mod.steps_per_epoch(n_train, batch, fixed_steps)
    spe = executions(training, per_epoch, strategy, device)
    built = build_trainer(
        spec,
        arrays.sample_shape,
        arrays.num_classes,
        spe,
        graph_rewrite=graph_rewrite,
        strategy=strategy,
        max_parameters=ctx.max_parameters,
    )
    x_all = tf.constant(arrays.x_train)
    y_all = tf.constant(arrays.y_train)
    feeds: list[EpochFeed] = []

    def epoch_data(epoch: int, skip: int) -> Any:
        order = data_mod.epoch_indices(n_train, batch, fixed_steps, training["seed"], epoch)
        if not feeds:
            feeds.append(EpochFeed(x_all, y_all, batch, len(order)))
        return feeds[0].epoch(order, skip)

    validation = (arrays.x_val, arrays.y_val) if arrays.x_val is not None else None
    return Plan(built, per_epoch, spe, epoch_data, validation, batch)


def run_plan(ctx: RunContext, plan: Plan, device: dict[str, Any]) -> str:
    """Resume, fit epoch by epoch with the step stream, and end: the part every job shares."""
    spec, training = ctx.spec, ctx.spec["training"]
    built, per_epoch = plan.built, plan.per_epoch
    model, trainer, recorder = built.model, built.trainer, built.recorder
    epochs = training["epochs"]
    total = per_epoch * epochs

    checkpointer = Checkpointer(ctx.job_dir, ctx.files)
    start = ctx.resume_step or 0
    # Only a committed checkpoint, whole and as committed, is resumed from (fetched from the
    # store into job_dir when it is remote). Without one, the supervisor sees start_step 0 in
    # "started" and records why in the job.
    if start and checkpointer.files.fetch_checkpoint(start) is None:
        print(f"halfway: checkpoint for step {start} is missing; starting over", flush=True)
        start = 0
    progress = checkpointer.restore(trainer, start) if start else None
    recorder.set_start(start)
    ls = spec["loss_scale"]
    guards = Guards(spec["guards"], ls["min_scale"] if ls["mode"] == "dynamic" else None)
    stream = StepStream(
        ctx,
        recorder,
        guards,
        checkpointer,
        training["checkpoint_every"],
        plan.batch_size or training["batch_size"],
    )
    if progress is not None:
        stream.resume(progress)
    if spec.get("outputs", {}).get("tensorboard"):
        stream.tensorboard = tf.summary.create_file_writer(str(ctx.job_dir / "tensorboard"))

    device["jit_compile"] = bool(trainer.jit_compile)
    ctx.emit(
        {
            "type": "started",
            "total_steps": total,
            "steps_per_epoch": per_epoch,
            "start_step": start,
            "steps_per_execution": plan.steps_per_execution,
            "precision_report": precision_report(model),
            "device": device,
        }
    )
    if start and plan.resume_note is not None:
        note = plan.resume_note(start // per_epoch, start % per_epoch)
        if note:
            ctx.emit({"type": "note", "message": note})

    for epoch in range(start // per_epoch, epochs):
        skip = start % per_epoch if epoch == start // per_epoch else 0
        try:
            trainer.fit(
                plan.epoch_data(epoch, skip),
                epochs=epoch + 1,
                initial_epoch=epoch,
                verbose=0,
                shuffle=False,  # the batch order is the plan's
                callbacks=[*plan.callbacks, stream],
                validation_data=plan.validation,
                validation_batch_size=plan.validation_batch_size,
            )
        except Exception as exc:
            blamed = plan.blame(exc) if plan.blame is not None else None
            if blamed is None:
                raise
            raise blamed from exc
        if trainer.stop_training:
            break

    stream.collect()
    stream.flush()
    if stream.failure is not None:
        raise JobError(stream.failure)
    if stream.stopped_by_signal:
        # The periodic checkpoint may already have saved this very step.
        if recorder.drained_to != stream.last_checkpoint:
            stream.checkpoint()
        return "cancelled"
    timing = stream.timing()
    timing.update(_peak_memory())
    # Updates the inner optimizer applied: the steps that were not skipped.
    timing["updates_applied"] = float(int(built.optimizer.iterations.numpy()))
    ctx.emit({"type": "metrics", "epoch": -1, "metrics": timing})
    if spec["outputs"]["save_model"]:
        with disk_errors_explained(ctx.job_dir):
            if plan.save is not None:
                saved = plan.save(ctx.job_dir)
            else:
                save_keras(model, ctx.job_dir / "model.keras")
                saved = ["model.keras"]
            for name in saved:
                checkpointer.files.publish(name)
    return "succeeded"


def save_keras(model: keras.Model, target: Path) -> None:
    """Written beside and renamed into place, so a reader never sees half a model."""
    partial = target.with_name(target.stem + ".partial.keras")
    model.save(partial)
    os.replace(partial, target)


@contextlib.contextmanager
def disk_errors_explained(directory: Path) -> Iterator[None]:
    """A full disk (or quota) is the job's to report, clearly and without a retry that would
    fail the same way; the worker itself is unaffected."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise JobError(
                f"no space left writing to {directory} ({os.strerror(exc.errno)}): free space "
                "on the artifact volume (HALFWAY_ARTIFACT_DIR) and submit again"
            ) from None
        raise


class EpochFeed:
    """The batches of an epoch, gathered from the in-memory arrays (as Keras' own array
    adapter does) in the epoch's sample order.

    The pipeline is built once per job: an epoch only writes its order into a variable that
    the pipeline reads. Building it per epoch (and re-capturing the arrays) cost several
    milliseconds per fit(), a few percent of a short epoch of a small model."""

    def __init__(self, x: Any, y: Any, batch: int, samples_per_epoch: int) -> None:
        self.x, self.y, self.batch = x, y, batch
        self.samples = samples_per_epoch
        self.steps = math.ceil(samples_per_epoch / batch)
        self.order = tf.Variable(tf.zeros((samples_per_epoch,), tf.int64), trainable=False)
        self.whole = self._pipeline(first=0)

    def _pipeline(self, first: int) -> Any:
        order, batch, samples = self.order, self.batch, self.samples

        def pick(i: Any, xy: Any) -> Any:
            start = i * batch
            idx = order[start : tf.minimum(start + batch, samples)]
            return tf.gather(xy[0], idx), tf.gather(xy[1], idx)

        # tf.data's default static optimizations rerun each time an iterator is opened, and
        # Keras opens two per fit(), i.e. per epoch here; this pipeline is already parallel
        # and prefetched, and iterates no slower without them.
        options = tf.data.Options()
        options.experimental_optimization.apply_default_optimizations = False
        arrays = tf.data.Dataset.from_tensors((self.x, self.y)).repeat()
        return (
            tf.data.Dataset.zip((tf.data.Dataset.range(first, self.steps), arrays))
            .map(pick, num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE)
            .with_options(options)
        )

    def epoch(self, order: np.ndarray, skip: int = 0) -> Any:
        """The dataset of one epoch, skipping the batches a resumed job already trained on."""
        self.order.assign(order)
        return self.whole if skip == 0 else self._pipeline(first=skip)


def epoch_dataset(x: Any, y: Any, order: np.ndarray, batch: int, skip: int) -> Any:
    """One epoch's batches, for callers that want a single epoch (tests, benchmarks)."""
    return EpochFeed(x, y, batch, len(order)).epoch(order, skip)


def _peak_memory() -> dict[str, float]:
    if not tf.config.list_physical_devices("GPU"):
        return {}
    try:
        return {"peak_memory_bytes": float(tf.config.experimental.get_memory_info("GPU:0")["peak"])}
    except (ValueError, RuntimeError):
        return {}


def scaler_state(optimizer: Any) -> dict[str, float] | None:
    if not isinstance(optimizer, HalfwayLossScaleOptimizer) or not optimizer.built:
        return None
    return {
        "scale": float(optimizer.scale.numpy()),
        "good_steps": int(optimizer.step_counter.numpy()),
        "hysteresis_left": int(optimizer.hysteresis_left.numpy()),
    }
