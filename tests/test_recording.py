"""Every training step is recorded, with the loss and scale that step really had, however
many steps one graph execution runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.training_runs import Run, job_spec, run_job
from workers.recording import StepRecorder
from workers.trainer import build_trainer

pytestmark = pytest.mark.keras

STEPS_PER_EPOCH = 23  # TINY: 23 batches of 16
# Two float16 roundings, relative: how far two kernels computing the same float16 step may
# land apart. Where the CPU has float16 instructions (AVX512-FP16), graph, eager and XLA take
# different kernels and differ by that much; where float16 is emulated they agree closer.
FLOAT16_ROUNDINGS = 2 * 2.0**-10


def overflow_spec(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """Overflows early and late in both epochs, growth every 4 clean steps."""
    return job_spec(
        tmp_path,
        loss_scale={"initial_scale": 1024, "growth_steps": 4},
        faults={"nonfinite_at_steps": [3, 9, 10, 22, 24, 44]},
        **sections,
    )


def column(run: Run, index: int) -> np.ndarray:
    return np.array([r[index] for r in run.records])


def test_every_step_is_recorded_once_including_each_epochs_partial_last_execution(
    tmp_path: Path,
) -> None:
    run = run_job(overflow_spec(tmp_path), tmp_path / "job")
    assert run.status == "succeeded", run.error
    assert run.started["steps_per_execution"] == 5
    total = 2 * STEPS_PER_EPOCH
    assert run.steps == list(range(total))
    assert [r[1] for r in run.records] == [s // STEPS_PER_EPOCH for s in range(total)]
    assert [s for s, *_, finite in run.records if not finite] == [3, 9, 10, 22, 24, 44]


def test_records_do_not_depend_on_steps_per_execution(tmp_path: Path) -> None:
    # One step per execution drains after every step, so it is the ground truth for what
    # the ring buffer must reproduce when five steps share an execution.
    batched = run_job(overflow_spec(tmp_path), tmp_path / "spe5")
    single = run_job(
        overflow_spec(tmp_path, training={"steps_per_execution": 1}), tmp_path / "spe1"
    )
    assert batched.status == single.status == "succeeded"
    assert single.started["steps_per_execution"] == 1
    assert batched.records == single.records


def test_xla_compiled_steps_record_every_step_like_the_graph_ones(tmp_path: Path) -> None:
    graph = run_job(overflow_spec(tmp_path), tmp_path / "graph")
    xla = run_job(overflow_spec(tmp_path, training={"jit_compile": True}), tmp_path / "xla")
    assert xla.status == "succeeded", xla.error
    assert xla.started["device"]["jit_compile"] is True
    assert graph.started["device"]["jit_compile"] is False
    assert xla.steps == list(range(2 * STEPS_PER_EPOCH))
    # The scale and finite flag follow from the faults alone; the loss only differs by how
    # XLA fuses float16 arithmetic (a step off by one would differ by percents).
    assert column(xla, 3).tolist() == column(graph, 3).tolist()
    assert column(xla, 4).tolist() == column(graph, 4).tolist()
    np.testing.assert_allclose(column(xla, 2), column(graph, 2), rtol=FLOAT16_ROUNDINGS)


def test_a_stopped_run_records_every_step_that_ran_and_checkpoints_after_the_last(
    tmp_path: Path,
) -> None:
    spec = overflow_spec(tmp_path, training={"epochs": 4, "checkpoint_every": 1000})
    run = run_job(spec, tmp_path / "job", stop_after_step=30)
    assert run.status == "cancelled", run.error
    ran = len(run.steps)
    assert run.steps == list(range(ran))

    def execution_end(step: int) -> int:
        start = step - step % STEPS_PER_EPOCH
        return min(start + (step - start) // 5 * 5 + 5, start + STEPS_PER_EPOCH)

    # The stop is set when the execution holding step 30 is sent; like SIGTERM, it lands
    # while the next execution runs, which finishes, and nothing runs after it.
    assert ran == execution_end(execution_end(30))
    assert [m["step"] for m in run.of_type("checkpoint")] == [ran]  # type: ignore[typeddict-item]


def snapshot(variables: list[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def test_recorded_loss_is_the_unscaled_batch_loss_and_scale_the_one_the_step_used(
    tmp_path: Path,
) -> None:
    faults = [4, 7]
    spec = job_spec(
        tmp_path,
        loss_scale={"initial_scale": 1024, "growth_steps": 3},
        faults={"nonfinite_at_steps": faults},
    )
    built = build_trainer(spec, (8,), 3, steps_per_execution=5)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((12 * 16, 8)).astype(np.float32)
    y = rng.integers(0, 3, 12 * 16).astype(np.int32)
    initial = snapshot(built.model.weights)
    drained = []

    class Drain(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
            drained.append(built.recorder.drain())

    history = built.trainer.fit(
        x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[Drain()]
    )
    assert [len(d) for d in drained] == [5, 5, 2]
    loss = np.concatenate([d.loss for d in drained])
    scale = np.concatenate([d.scale for d in drained])
    finite = np.concatenate([d.finite for d in drained])

    # An independent replay, eagerly, one step at a time: the same model and weights, stock
    # Keras' LossScaleOptimizer, the loss of each batch before that batch's update.
    replica = keras.models.clone_model(built.model)
    replica.set_weights(initial)
    stock = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(spec["optimizer"]["learning_rate"]),
        initial_scale=1024,
        dynamic_growth_steps=3,
    )
    stock.build(replica.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    expected_loss, expected_scale, expected_finite = [], [], []
    for step in range(12):
        xb, yb = x[step * 16 : (step + 1) * 16], y[step * 16 : (step + 1) * 16]
        with tf.GradientTape() as tape:
            batch_loss = loss_fn(yb, replica(xb, training=True))
            scaled = stock.scale_loss(batch_loss)
        grads = tape.gradient(scaled, replica.trainable_variables)
        if step in faults:
            grads = [g * np.inf for g in grads]
        expected_loss.append(float(batch_loss))
        expected_scale.append(float(stock.dynamic_scale.numpy()))
        expected_finite.append(bool(stock.check_finite(grads)))
        stock.apply(grads, replica.trainable_variables)

    assert scale.tolist() == expected_scale
    assert finite.tolist() == expected_finite == [s not in faults for s in range(12)]
    # Graph and eager float16 kernels may round differently; a scaled loss would be off by
    # a factor of 1024 and a running mean by far more than this.
    np.testing.assert_allclose(loss, expected_loss, rtol=FLOAT16_ROUNDINGS)
    for ours, theirs in zip(built.model.weights, replica.weights, strict=True):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-3, atol=1e-5)
    # Keras' own epoch loss is the mean over the batches: the per-step records average to it.
    assert np.mean(loss) == pytest.approx(history.history["loss"][-1], rel=1e-5)
    assert len(set(loss.tolist())) == 12


def test_ring_buffer_drains_in_step_order_across_wraparound() -> None:
    recorder = StepRecorder(capacity=4)
    recorder.set_start(6)
    drains = []
    for batch in ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [], [8.0]):
        for value in batch:
            recorder.record(tf.constant(value), tf.constant(value * 10), tf.constant(value != 5))
        drains.append(recorder.drain())
    assert [d.first for d in drains] == [6, 9, 13, 13]
    assert [d.loss.tolist() for d in drains] == [[1, 2, 3], [4, 5, 6, 7], [], [8]]
    assert drains[1].scale.tolist() == [40, 50, 60, 70]
    assert drains[1].finite.tolist() == [True, False, True, True]
    assert int(recorder.count.numpy()) == 14


def test_ring_buffer_refuses_to_drain_records_it_has_overwritten() -> None:
    recorder = StepRecorder(capacity=2)
    for value in (1.0, 2.0, 3.0):
        recorder.record(tf.constant(value), tf.constant(1.0), tf.constant(True))
    with pytest.raises(RuntimeError, match="3 steps ran between drains"):
        recorder.drain()


def test_a_checkpoint_at_an_epochs_last_step_follows_that_epochs_metrics(tmp_path: Path) -> None:
    """A checkpoint due on the last step of an epoch is taken after the epoch's metrics are
    sent. Taken before, a crash between the two (in validation, say) resumed the job at the
    next epoch with the finished epoch's metrics never stored."""
    spec = job_spec(tmp_path, training={"epochs": 3, "checkpoint_every": 23})
    run = run_job(spec, tmp_path / "job")
    assert run.status == "succeeded", run.error
    order = [
        (m["type"], m["epoch"] if m["type"] == "metrics" else m["step"])
        for m in run.messages
        if m["type"] == "checkpoint" or (m["type"] == "metrics" and m["epoch"] >= 0)
    ]
    # 23 steps per epoch: each epoch's metrics, then the checkpoint of its last step.
    assert order == [
        ("metrics", 0), ("checkpoint", 23),
        ("metrics", 1), ("checkpoint", 46),
        ("metrics", 2), ("checkpoint", 69),
    ]  # fmt: skip


def test_a_gradient_sample_reaches_the_supervisor_after_the_rows_of_its_step(
    tmp_path: Path,
) -> None:
    """The supervisor may store what it has received at any moment (a checkpoint's
    acknowledgement forces a write), so a sample sent before its step's row could be stored
    without it: a crash then left a sample past the history's end, and the resume's cut of it
    moved ``history_version`` although no row was rewritten."""
    spec = job_spec(tmp_path, training={"epochs": 2}, gradients={"every": 7, "shadow_every": 14})
    run = run_job(spec, tmp_path / "job")
    assert run.status == "succeeded", run.error
    sent_to = -1  # the last step whose row has been sent
    sampled = []
    for m in run.messages:
        if m["type"] == "steps":
            sent_to = m["records"][-1][0]
        elif m["type"] == "gradients":
            steps = [s["step"] for s in m["samples"]]
            assert max(steps) <= sent_to, (steps, sent_to)
            sampled += steps
    assert sampled == list(range(0, 46, 7))
