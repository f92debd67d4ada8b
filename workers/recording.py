"""Recording every step without syncing every step.

Keras runs ``steps_per_execution`` train steps inside one graph call, and the host only sees
the last one's logs. So each train step writes its record (unscaled loss, the scale that
multiplied it, the finite flag) into a ring buffer of variables inside the graph, and the host
drains the buffer once per execution: one device-to-host copy per ``steps_per_execution``
steps instead of one per step.

``HalfwayTrainer`` wraps the user's model (Sequential or Functional) and replaces only
``train_step``; the wrapped model is what gets saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

from workers.gradients import GradientMeter, float32_compute
from workers.scaler import HalfwayLossScaleOptimizer

LOSS, SCALE, FINITE = 0, 1, 2


@dataclass(frozen=True)
class Drained:
    """Records of steps ``first .. first + len(loss) - 1``."""

    first: int
    loss: np.ndarray
    scale: np.ndarray
    finite: np.ndarray

    def __len__(self) -> int:
        return len(self.loss)


def writes_here() -> bool:
    """Whether the step being traced should write Halfway's host-read variables. Every replica
    holds the same (all-reduced) record; MirroredStrategy traces the step once per replica,
    each with its id as a constant, so the choice is made while tracing: the first writes."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return True
    replica = tf.get_static_value(ctx.replica_id_in_sync_group)
    if replica is None:
        raise RuntimeError("recording needs a strategy whose replica ids are static")
    return int(replica) == 0


class StepRecorder:
    """The in-graph ring buffer. ``count`` is the global step (skipped steps included); the
    checkpoint's step restores it, so a resumed job numbers its steps where it left off.

    Plain variables, created outside any distribution strategy: under MirroredStrategy every
    replica holds the same (all-reduced) record, and the first replica alone writes it."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.count = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="halfway_step")
        self.buffer = tf.Variable(
            tf.zeros((capacity, 3), tf.float32), trainable=False, name="halfway_step_records"
        )
        self.drained_to = 0  # host side: the first global step not yet drained

    def record(self, loss: Any, scale: Any, finite: Any) -> None:
        """Called inside the train step (graph), in every replica."""
        if writes_here():
            self._write(loss, scale, finite)

    def _write(self, loss: Any, scale: Any, finite: Any) -> None:
        slot = tf.math.floormod(self.count, self.capacity)
        row = tf.stack(
            [tf.cast(loss, tf.float32), tf.cast(scale, tf.float32), tf.cast(finite, tf.float32)]
        )
        self.buffer.scatter_nd_update(tf.reshape(slot, (1, 1)), tf.reshape(row, (1, 3)))
        self.count.assign_add(1)

    def set_start(self, step: int) -> None:
        self.count.assign(step)
        self.drained_to = step

    def drain(self) -> Drained:
        """Host side: copy out the records written since the last drain, in step order."""
        count = int(self.count.numpy())
        fresh = count - self.drained_to
        if fresh > self.capacity:
            raise RuntimeError(
                f"{fresh} steps ran between drains but the ring buffer holds {self.capacity}"
            )
        first = self.drained_to
        if fresh <= 0:
            empty = np.zeros((0,), np.float32)
            return Drained(first, empty, empty, empty.astype(bool))
        buf = self.buffer.numpy()
        slots = np.arange(first, count) % self.capacity
        rows = buf[slots]
        self.drained_to = count
        return Drained(first, rows[:, LOSS], rows[:, SCALE], rows[:, FINITE] > 0.5)


class OverflowForensics:
    """Which variables had non-finite gradients, on a job's first ``captures`` non-finite
    steps, with the loss and the scale of that step. Captured in the graph (a few small
    writes, only on such a step), read by the host once per execution."""

    def __init__(self, variables: list[Any], captures: int) -> None:
        self.names = [str(getattr(v, "path", v.name)) for v in variables]
        self.captures = captures
        slots, width = max(captures, 1), max(len(variables), 1)
        self.count = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="forensics_n")
        self.steps = tf.Variable(tf.zeros((slots,), tf.int64), trainable=False)
        self.values = tf.Variable(tf.zeros((slots, 2), tf.float32), trainable=False)
        self.flags = tf.Variable(tf.zeros((slots, width), tf.float32), trainable=False)
        self.read = 0

    def capture(
        self, step: Any, finite: Any, per_variable: list[Any], loss: Any, scale: Any
    ) -> None:
        """Graph side, called with the step's (global) finite flag and each variable's."""
        if self.captures == 0 or not per_variable:
            return
        if not writes_here():
            return

        def write() -> Any:
            slot = tf.reshape(self.count, (1, 1))
            self.steps.scatter_nd_update(slot, tf.reshape(step, (1,)))
            row = tf.stack([tf.cast(loss, tf.float32), tf.cast(scale, tf.float32)])
            self.values.scatter_nd_update(slot, tf.reshape(row, (1, 2)))
            bad = 1.0 - tf.cast(tf.stack(per_variable), tf.float32)
            self.flags.scatter_nd_update(slot, tf.reshape(bad, (1, -1)))
            self.count.assign_add(1)
            return tf.constant(True)

        wanted = tf.logical_and(tf.logical_not(finite), self.count < self.captures)
        tf.cond(wanted, write, lambda: tf.constant(False))

    def drain(self) -> list[dict[str, Any]]:
        """Host side: the captures made since the last drain."""
        if self.captures == 0:
            return []
        count = int(self.count.numpy())
        if count <= self.read:
            return []
        steps, values, flags = self.steps.numpy(), self.values.numpy(), self.flags.numpy()
        out = []
        for i in range(self.read, count):
            out.append(
                {
                    "step": int(steps[i]),
                    "loss": float(values[i, 0]),
                    "loss_scale": float(values[i, 1]),
                    "nonfinite_variables": [
                        name for name, bad in zip(self.names, flags[i], strict=False) if bad > 0.5
                    ],
                    "variables": len(self.names),
                }
            )
        self.read = count
        return out


class HalfwayTrainer(keras.Model):  # type: ignore[misc]
    """Trains ``inner`` with Halfway's step: loss scaling, fault injection, step recording."""

    def __init__(
        self,
        inner: keras.Model,
        recorder: StepRecorder,
        *,
        fault_steps: list[int] | None = None,
        fault_variables: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.inner = inner
        self.recorder = recorder
        self.forensics: OverflowForensics | None = None
        self.meter: GradientMeter | None = None
        # Which train function is being traced: the metered one or the plain one (see
        # make_train_function). Read while tracing.
        self._metered = True
        # Told before a step function's first call, which traces and compiles it (set by
        # workers.training, to tell the supervisor: the watchdog counts that as starting).
        self.on_compile: Callable[[str], None] | None = None
        self._fault_steps = tf.constant(sorted(fault_steps), tf.int64) if fault_steps else None
        self._fault_variables = list(fault_variables or [])

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.inner(inputs, training=training)

    def train_step(self, data: Any) -> Any:
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        scaler = optimizer if isinstance(optimizer, HalfwayLossScaleOptimizer) else None
        meter = self.meter if self._metered else None
        shadowed = meter is not None and meter.shadows
        # The shadow replays this step's forward pass: it needs the state (batch-norm
        # statistics, dropout seeds) as it was before the step's own pass moves it on.
        state = (
            [tf.identity(v.value) for v in self.inner.non_trainable_variables] if shadowed else []
        )
        with tf.GradientTape() as tape:
            y_pred = self.inner(x, training=True)
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
            batch = tf.shape(tf.nest.flatten(x)[0])[0]
            self._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss), sample_weight=batch
            )
            # Read the scale before the update so the record holds the scale this step used.
            scale = tf.identity(scaler.scale.value) if scaler is not None else tf.constant(1.0)
            scaled_loss = loss * tf.cast(scale, loss.dtype) if scaler is not None else loss
        weights = self.trainable_variables
        grads = tape.gradient(scaled_loss, weights)
        if self._fault_steps is not None:
            grads = self._inject_nonfinite(grads)
        # One check per variable, used three times: the skip decision, the record, and (on a
        # job's first overflows) the forensics of which variables overflowed.
        per_variable = [
            tf.reduce_all(tf.math.is_finite(g)) if g is not None else tf.constant(True)
            for g in grads
        ]
        local = tf.reduce_all(tf.stack(per_variable))
        if meter is not None and writes_here():
            reference = (lambda: self._shadow(x, y, sample_weight, state)) if shadowed else None
            # Before the update: the shadow reads the weights this step's gradients are of.
            meter.measure(self.recorder.count, scale, grads, reference)
        if scaler is not None:
            finite = scaler.apply_and_check(grads, weights, finite=local)
        else:
            finite = self._all_replicas(local)
            optimizer.apply(grads, weights)
        step = self.recorder.count.read_value()
        global_loss = self._global_loss(loss)
        if self.forensics is not None:
            self.forensics.capture(step, finite, per_variable, global_loss, scale)
        self.recorder.record(global_loss, scale, finite)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def make_train_function(self, force: bool = False) -> Any:
        """With a gradient meter, two compiled train functions, chosen per execution on the
        host: the metered step for an execution that holds a sampled step, the plain one
        (no meter at all) for the others, unless the job is too short for its trace to pay
        (``GradientMeter.metered``). Each is traced when first needed, said first
        (``on_compile``)."""
        current: Any = getattr(self, "train_function", None)  # Keras sets it untyped
        if current is not None and not force:
            return current
        meter = self.meter
        compiled: dict[bool, Any] = {}

        def run(iterator: Any) -> Any:
            metered = False
            if meter is not None:
                first = int(self.recorder.count.numpy())
                metered = meter.metered(first, int(self.steps_per_execution), set(compiled))
            # Set on every call: a function traces again for a new batch shape.
            self._metered = metered
            if metered not in compiled:
                super(HalfwayTrainer, self).make_train_function(force=True)
                made = getattr(self, "train_function")  # noqa: B009
                what = "the metered train step" if metered else "the train step"
                compiled[metered] = self._announced(made, what)
                self.train_function = run
            return compiled[metered](iterator)

        self.train_function = run
        return run

    def make_test_function(self, force: bool = False) -> Any:
        """Keras's, said (``on_compile``) before its first call traces it: the validation
        at the end of the first epoch."""
        current: Any = getattr(self, "test_function", None)
        if current is not None and not force:
            return current
        super().make_test_function(force)  # Keras's sets test_function and returns None
        made = getattr(self, "test_function")  # noqa: B009
        self.test_function = self._announced(made, "the validation step")
        return self.test_function

    def _announced(self, function: Any, what: str) -> Any:
        """``function``, telling ``on_compile`` before its first call (which traces it)."""
        called = False

        def call(iterator: Any) -> Any:
            nonlocal called
            if not called and self.on_compile is not None:
                self.on_compile(what)
            called = True
            return function(iterator)

        return call

    def _shadow(self, x: Any, y: Any, sample_weight: Any, state: list[Any]) -> list[Any]:
        """The float32 shadow's gradients, unscaled, in ``trainable_variables``' order: the
        same batch through the same weights and state, computed in float32, written nowhere."""
        inner = self.inner
        values = [tf.identity(v.value) for v in inner.trainable_variables]
        with tf.GradientTape() as tape:
            tape.watch(values)
            with float32_compute(inner):
                # As Layer.__call__ does: ``training`` only to a call() that takes it.
                flags = {"training": True} if inner._call_has_training_arg else {}
                y_pred, _, extra = inner.stateless_call(
                    values, state, x, return_losses=True, **flags
                )
            # A multi-output loss updates per-output trackers: keep those writes out too.
            with keras.StatelessScope():
                loss = self._compile_loss(y, tf.nest.map_structure(_f32, y_pred), sample_weight)
                for term in extra:
                    loss = loss + self._aggregate_additional_loss(_f32(term))
        grads = tape.gradient(loss, values)
        index = {id(v): i for i, v in enumerate(inner.trainable_variables)}
        return [grads[index[id(v)]] if id(v) in index else None for v in self.trainable_variables]

    def _inject_nonfinite(self, grads: list[Any]) -> list[Any]:
        """Rehearsal: at the listed global steps, make the gradients non-finite (all of them,
        or those of the variables whose path contains one of ``fault_variables``)."""
        assert self._fault_steps is not None
        hit = tf.reduce_any(tf.equal(self._fault_steps, self.recorder.count))
        factor = tf.where(hit, tf.constant(np.inf, tf.float32), tf.constant(1.0, tf.float32))
        out = []
        for g, v in zip(grads, self.trainable_variables, strict=True):
            path = str(getattr(v, "path", v.name))
            targeted = not self._fault_variables or any(p in path for p in self._fault_variables)
            out.append(g * tf.cast(factor, g.dtype) if g is not None and targeted else g)
        return out

    def _all_replicas(self, finite: Any) -> Any:
        """Finite everywhere: each replica checked only its own (not yet reduced) gradients."""
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return finite
        bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(finite, tf.float32))
        return bad < 0.5

    def _global_loss(self, loss: Any) -> Any:
        """Under a distribution strategy each replica holds its share of the batch's loss;
        the record is the whole batch's."""
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            return loss
        return ctx.all_reduce(tf.distribute.ReduceOp.SUM, loss)


def _f32(t: Any) -> Any:
    return tf.cast(t, tf.float32) if t.dtype.is_floating else t
