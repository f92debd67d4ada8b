"""The gradient meter: what the loss scale is for, measured in the train step.

Every ``every`` steps it counts, per trainable variable, what the scaled gradient ``G`` holds
(zeros, largest, smallest nonzero, float16-subnormal elements); every ``shadow_every`` steps
it also computes the *float32 shadow*: the same batch, the same weights, float32 compute, no
scaling, giving the reference gradient ``g32`` against which float16's underflow and what the
run really lost are counted. The counts go to a ring buffer of variables read by the host once
per execution, as the step records are (``workers.recording``); ``workers.gradstats`` turns
them into the figures users read.

The shadow calls the user's model with ``stateless_call``: the weights, the batch-norm
statistics and the dropout seeds it reads are the step's own, read before the step's forward
pass, and nothing it computes is written back, so the run trains exactly as without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util_v2

from workers import gradstats as gs
from workers.protocol import Sample

F64 = tf.float64
# A job with fewer steps left than this, once its metered step is traced, runs that step for
# its remaining executions instead of tracing the plain one. The break-even is the plain
# step's trace over what the metered step costs a step when it samples nothing (its untaken
# branches); benchmarks/gradients.py measures it (docs/results.md), and this sits below it,
# so a job near the line still gets the faster plain step.
PLAIN_TRACE_STEPS = 4000


def _count(mask: Any) -> Any:
    return tf.cast(tf.math.count_nonzero(mask), F64)


def g_counts(g: Any) -> list[Any]:
    """The ``G`` columns of one variable's row (``gradstats.ZEROS .. FINITE``)."""
    g = tf.cast(g, tf.float32)
    a = tf.abs(g)
    nonzero = a > 0
    return [
        _count(tf.equal(g, 0.0)),
        tf.cast(tf.size(g), F64),
        tf.cast(tf.reduce_max(a), F64),
        tf.cast(tf.reduce_min(tf.where(nonzero, a, np.inf)), F64),
        _count(tf.logical_and(nonzero, a < gs.FLOAT16_MIN_NORMAL)),
        tf.cast(tf.reduce_all(tf.math.is_finite(g)), F64),
    ]


def shadow_counts(g: Any, g32: Any, scale: Any) -> list[Any]:
    """The shadow's columns (``gradstats.REF_NONZERO .. REF_SQ``) of one variable's row."""
    g = tf.cast(g, F64)
    ref = tf.cast(g32, F64)
    s = tf.cast(scale, F64)
    present = tf.not_equal(ref, 0.0)
    return [
        _count(present),
        _count(tf.logical_and(present, tf.abs(ref) * s < gs.FLOAT16_MIN_SUBNORMAL)),
        _count(tf.logical_and(present, tf.equal(g, 0.0))),
        tf.reduce_sum(tf.square(g / s - ref)),
        tf.reduce_sum(tf.square(ref)),
    ]


@contextlib.contextmanager
def functional_conds() -> Iterator[None]:
    """While tracing: ``tf.cond`` builds an ``If`` that runs only the branch it takes, as a
    function call, instead of being lowered to switch and merge nodes. Lowered, every step
    pays for the meter's untaken branches: each of their nodes (the shadow's whole forward and
    backward pass among them) is visited to mark it dead. benchmarks/gradients.py measures
    what the untaken branches cost ("metered, nothing due"). TensorFlow has no public switch
    for this; the flag is read only while a cond is built, and XLA ignores it."""
    saved = control_flow_util_v2._DISABLE_LOWER_USING_SWITCH_MERGE
    control_flow_util_v2._DISABLE_LOWER_USING_SWITCH_MERGE = True
    try:
        yield
    finally:
        control_flow_util_v2._DISABLE_LOWER_USING_SWITCH_MERGE = saved


@contextlib.contextmanager
def float32_compute(model: keras.Layer) -> Iterator[None]:
    """While tracing: every layer of ``model`` computes in float32 (its variables keep their
    dtype). Layers read their policy when called, so the traced shadow is float32 throughout."""
    layers = list(model._flatten_layers(include_self=True))
    saved = [layer._dtype_policy for layer in layers]
    float32 = keras.dtype_policies.get("float32")
    try:
        for layer in layers:
            layer._dtype_policy = float32
        yield
    finally:
        for layer, policy in zip(layers, saved, strict=True):
            layer._dtype_policy = policy


class GradientMeter:
    """In-graph sampling of gradient statistics (see the module docstring)."""

    def __init__(
        self, variables: list[Any], every: int, shadow_every: int, steps_per_execution: int
    ) -> None:
        self.names = [str(getattr(v, "path", v.name)) for v in variables]
        self.every = every
        self.shadow_every = shadow_every
        self.slots = steps_per_execution // max(min(every or 1, shadow_every or 1), 1) + 2
        width = max(len(variables), 1)
        # Host side: False keeps the meter out of every execution (the auto probe's timing).
        self.active = True
        # The global step the job ends at (set by workers.training); None: not known.
        self.ends_at: int | None = None
        self.count = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="gradients_n")
        self.steps = tf.Variable(tf.zeros((self.slots,), tf.int64), trainable=False)
        self.meta = tf.Variable(tf.zeros((self.slots, 2), F64), trainable=False)
        self.rows = tf.Variable(tf.zeros((self.slots, width, gs.WIDTH), F64), trainable=False)
        self.read = 0

    @property
    def shadows(self) -> bool:
        return self.shadow_every > 0

    def due(self, step: Any, every: int) -> Any:
        if every <= 0:
            return tf.constant(False)
        return tf.equal(tf.math.floormod(step, every), 0)

    def due_within(self, first: int, steps: int) -> bool:
        """Host side: whether any of the global steps ``first .. first + steps - 1`` (one
        execution) takes a sample. Only such executions run the metered step: the meter's
        branches cost a few percent of every step they are in, taken or not."""
        if not self.active:
            return False
        for period in (self.every, self.shadow_every):
            if period > 0 and -(-first // period) * period < first + steps:
                return True
        return False

    def metered(self, first: int, steps: int, traced: set[bool]) -> bool:
        """Host side: whether the execution of global steps ``first .. first + steps - 1``
        runs the metered step, given which steps are ``traced`` already (True: the metered
        one): when it samples, or when the plain step is not traced and the job is too near
        its end for that trace to pay (``PLAIN_TRACE_STEPS``)."""
        if self.due_within(first, steps):
            return True
        return (
            self.active
            and traced == {True}
            and self.ends_at is not None
            and self.ends_at - first < PLAIN_TRACE_STEPS
        )

    def measure(
        self,
        step: Any,
        scale: Any,
        grads: list[Any],
        reference: Callable[[], list[Any]] | None,
    ) -> None:
        """Graph side, after the step's gradients ``grads`` (of the scaled loss) are known and
        before they are applied. ``reference`` computes the shadow's gradients (traced only
        when the job has a shadow)."""
        if not grads:
            return
        shadow_due = self.due(step, self.shadow_every)
        sample_due = tf.logical_or(self.due(step, self.every), shadow_due)

        def g_rows() -> Any:
            return tf.stack(
                [tf.stack(g_counts(g) if g is not None else _absent(), axis=0) for g in grads]
            )

        def shadow_rows() -> Any:
            assert reference is not None
            ref = reference()
            return tf.stack(
                [
                    tf.stack(
                        shadow_counts(g, r, scale)
                        if g is not None and r is not None
                        else [tf.constant(0.0, F64)] * 5
                    )
                    for g, r in zip(grads, ref, strict=True)
                ]
            )

        def no_shadow() -> Any:
            return tf.zeros((len(grads), 5), F64)

        def write() -> Any:
            if reference is not None:
                shadow = tf.cond(shadow_due, shadow_rows, no_shadow)
            else:
                shadow = no_shadow()
            rows = tf.concat([g_rows(), shadow], axis=1)
            slot = tf.reshape(tf.math.floormod(self.count, self.slots), (1, 1))
            self.steps.scatter_nd_update(slot, tf.reshape(tf.cast(step, tf.int64), (1,)))
            took = tf.cast(tf.logical_and(shadow_due, reference is not None), F64)
            self.meta.scatter_nd_update(
                slot, tf.reshape(tf.stack([tf.cast(scale, F64), took]), (1, 2))
            )
            self.rows.scatter_nd_update(slot, tf.expand_dims(rows, 0))
            self.count.assign_add(1)
            return tf.constant(True)

        with functional_conds():
            tf.cond(sample_due, write, lambda: tf.constant(False))

    def drain(self) -> list[Sample]:
        """Host side: the samples taken since the last drain, in step order."""
        count = int(self.count.numpy())
        if count <= self.read:
            return []
        if count - self.read > self.slots:
            raise RuntimeError(
                f"{count - self.read} gradient samples between drains; the buffer holds "
                f"{self.slots}"
            )
        steps, meta, rows = self.steps.numpy(), self.meta.numpy(), self.rows.numpy()
        out = []
        for i in range(self.read, count):
            slot = i % self.slots
            out.append(
                gs.sample(
                    int(steps[slot]),
                    float(meta[slot, 0]),
                    bool(meta[slot, 1] > 0.5),
                    self.names,
                    rows[slot, : len(self.names)],
                )
            )
        self.read = count
        return out


def _absent() -> list[Any]:
    """A variable without a gradient (unused by the loss): all zero, nothing to count."""
    zero = tf.constant(0.0, F64)
    return [zero, zero, zero, tf.constant(np.inf, F64), zero, tf.constant(1.0, F64)]
