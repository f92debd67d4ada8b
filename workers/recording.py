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

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.losses import loss as loss_module
from keras.src.trainers.data_adapters import data_adapter_utils

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
        ctx = tf.distribute.get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            self._write(loss, scale, finite)
            return
        # MirroredStrategy traces the step once per replica, each with its id as a constant,
        # so the choice is made while tracing: only the first replica's graph writes.
        replica = tf.get_static_value(ctx.replica_id_in_sync_group)
        if replica is None:
            raise RuntimeError("recording needs a strategy whose replica ids are static")
        if int(replica) == 0:
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


class HalfwayTrainer(keras.Model):  # type: ignore[misc]
    """Trains ``inner`` with Halfway's step: loss scaling, fault injection, step recording."""

    def __init__(
        self,
        inner: keras.Model,
        recorder: StepRecorder,
        *,
        fault_steps: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.inner = inner
        self.recorder = recorder
        self._fault_steps = tf.constant(sorted(fault_steps), tf.int64) if fault_steps else None

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.inner(inputs, training=training)

    def train_step(self, data: Any) -> Any:
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        scaler = optimizer if isinstance(optimizer, HalfwayLossScaleOptimizer) else None
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
        if scaler is not None:
            finite = scaler.apply_and_check(grads, weights)
        else:
            finite = self._all_replicas(
                tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None])
            )
            optimizer.apply(grads, weights)
        self.recorder.record(self._global_loss(loss), scale, finite)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _inject_nonfinite(self, grads: list[Any]) -> list[Any]:
        """Rehearsal: at the listed global steps, make every gradient non-finite."""
        assert self._fault_steps is not None
        hit = tf.reduce_any(tf.equal(self._fault_steps, self.recorder.count))
        factor = tf.where(hit, tf.constant(np.inf, tf.float32), tf.constant(1.0, tf.float32))
        return [None if g is None else g * tf.cast(factor, g.dtype) for g in grads]

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
