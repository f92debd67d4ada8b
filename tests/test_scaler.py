"""Halfway's loss scaler against stock Keras and against the plain-Python rules in
``tests/reference.py``, and its state across a checkpoint and a resumed job."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.reference import expected_scales
from tests.training_runs import job_spec, run_job
from workers.checkpointer import Checkpointer
from workers.recording import Drained, StepRecorder
from workers.scaler import HalfwayLossScaleOptimizer, make_scaler
from workers.trainer import Built, build_trainer, scaler_state

pytestmark = pytest.mark.keras

SHAPES = [(3, 2), (2,)]


def gradient_steps(pattern: str, seed: int = 1) -> list[list[np.ndarray]]:
    """One list of gradients per character: ``.`` finite, ``i`` +inf, ``m`` -inf, ``n`` NaN
    (in one element of one gradient, the way a single overflowing layer looks)."""
    rng = np.random.default_rng(seed)
    steps = []
    for i, c in enumerate(pattern):
        grads = [rng.standard_normal(s).astype(np.float32) * 100 for s in SHAPES]
        bad = {"i": np.inf, "m": -np.inf, "n": np.nan}.get(c)
        if bad is not None:
            grads[i % 2].flat[0] = bad
        steps.append(grads)
    return steps


def twin_variables() -> tuple[list[keras.Variable], list[keras.Variable]]:
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    return [keras.Variable(w) for w in init], [keras.Variable(w) for w in init]


def values(variables: list[Any]) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in variables]


def applier(
    opt: keras.optimizers.Optimizer, variables: list[keras.Variable], graph: bool
) -> Callable[[list[Any]], None]:
    # The variables are closed over, not passed: a tf.function would trace them as tensors.
    def apply(grads: list[Any]) -> None:
        opt.apply(grads, variables)

    return tf.function(apply) if graph else apply


INNER: dict[str, Callable[[], keras.optimizers.Optimizer]] = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
}


@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_default_knobs_match_stock_keras_step_for_step_on_finite_inf_and_nan_gradients(
    inner: str, graph: bool
) -> None:
    ours_vars, stock_vars = twin_variables()
    ours = HalfwayLossScaleOptimizer(INNER[inner](), growth_steps=3)
    stock = keras.optimizers.LossScaleOptimizer(INNER[inner](), dynamic_growth_steps=3)
    ours.build(ours_vars)
    stock.build(stock_vars)
    apply_ours = applier(ours, ours_vars, graph)
    apply_stock = applier(stock, stock_vars, graph)
    pattern = "......." + "i.." + "n...." + "mmm" + "..." + "n" + "......"
    scales = []
    for step, grads in enumerate(gradient_steps(pattern)):
        before = values(ours_vars)
        apply_ours([tf.constant(g) for g in grads])
        apply_stock([tf.constant(g) for g in grads])
        assert float(ours.scale.numpy()) == float(stock.dynamic_scale.numpy()), step
        assert int(ours.step_counter.numpy()) == int(stock.step_counter.numpy()), step
        assert int(ours.iterations.numpy()) == int(stock.iterations.numpy()), step
        for a, b in zip(ours_vars, stock_vars, strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"step {step}")
        if pattern[step] != ".":
            for a, b in zip(before, values(ours_vars), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"skipped step {step}")
        scales.append(float(ours.scale.numpy()))
    # The pattern really made the scale grow and back off.
    assert max(scales) > 2.0**15 > min(scales)
    assert int(ours.iterations.numpy()) == pattern.count(".")


def drive(opt: HalfwayLossScaleOptimizer, pattern: str) -> list[float]:
    """Apply one step per character of ``pattern`` and return the scale each step used."""
    variable = keras.Variable(np.ones((2,), np.float32))
    opt.build([variable])
    used = []
    for c in pattern:
        used.append(float(opt.scale.numpy()))
        grad = np.full((2,), np.inf if c == "i" else 0.5, np.float32)
        opt.apply([tf.constant(grad)], [variable])
    return used


KNOBS: dict[str, tuple[dict[str, Any], str]] = {
    "defaults": ({"growth_steps": 3}, ".........i...ii......"),
    "growth_factor": ({"growth_steps": 2, "growth_factor": 4.0}, "......i...."),
    "backoff_factor": ({"growth_steps": 3, "backoff_factor": 0.25}, "...ii..i...."),
    "min_scale": (
        {"initial_scale": 16.0, "min_scale": 4.0, "growth_steps": 2},
        "iiiiii...iii..",
    ),
    "max_scale": ({"initial_scale": 2.0**10, "max_scale": 2.0**12, "growth_steps": 2}, "." * 12),
    "hysteresis": ({"growth_steps": 3, "hysteresis": 3}, "iiii...ii.i..iii"),
    "all_knobs": (
        {
            "initial_scale": 64.0,
            "growth_steps": 2,
            "growth_factor": 8.0,
            "backoff_factor": 0.125,
            "min_scale": 2.0,
            "max_scale": 2.0**9,
            "hysteresis": 2,
        },
        "......ii.iiiiii....i.iii",
    ),
}


@pytest.mark.parametrize("case", sorted(KNOBS))
def test_each_knob_follows_the_reference_rules(case: str) -> None:
    knobs, pattern = KNOBS[case]
    opt = HalfwayLossScaleOptimizer(keras.optimizers.SGD(0.1), **knobs)
    used = drive(opt, pattern)
    finite = [c == "." for c in pattern]
    reference = {("initial" if k == "initial_scale" else k): v for k, v in knobs.items()}
    assert used == expected_scales(finite, **reference)
    # The pattern exercises what the case is about: with those knobs back at their
    # defaults the sequence would differ (and with all defaults it both grows and backs off).
    setup = {"initial", "growth_steps"}
    defaults = {k: v for k, v in reference.items() if k in setup}
    if set(reference) - setup:
        assert used != expected_scales(finite, **defaults)
    assert max(used) > used[0] or min(used) < used[0]


def test_factors_that_float32_rounds_still_follow_the_rules() -> None:
    knobs: dict[str, Any] = {
        "growth_steps": 2,
        "growth_factor": 3.0,
        "backoff_factor": 0.3,
        "min_scale": 0.7,
    }
    pattern = "..i.....ii...i....iiiiii"
    opt = HalfwayLossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=5.0, **knobs)
    used = drive(opt, pattern)
    expected = expected_scales([c == "." for c in pattern], initial=5.0, **knobs)
    # The scaler computes in float32, the reference in float64.
    np.testing.assert_allclose(used, expected, rtol=1e-6)
    assert min(used) == np.float32(0.7)


def test_min_scale_floors_the_scale_where_stock_keras_keeps_halving() -> None:
    pattern = "i" * 20
    ours = HalfwayLossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    used = drive(ours, pattern)
    stock_var = keras.Variable(np.ones((2,), np.float32))
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    for _ in pattern:
        stock.apply([tf.constant(np.full((2,), np.inf, np.float32))], [stock_var])
    assert float(stock.dynamic_scale.numpy()) < 1e-4  # what the floor protects against
    assert used[:5] == [8.0, 4.0, 2.0, 1.0, 1.0]
    assert min(used) == 1.0 and float(ours.scale.numpy()) == 1.0


def test_hysteresis_tolerates_overflows_until_spent_and_growth_refills_it() -> None:
    opt = HalfwayLossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=1024.0, growth_steps=2, hysteresis=2
    )
    # Spelled out (Megatron): of a budget of 2, the first overflow spends one unit and is
    # tolerated, the second backs off, and with the budget gone every further overflow backs
    # off too until a growth refills it; then the next overflow is tolerated again.
    used = drive(opt, "iii..i" + "i")
    assert used == [1024, 1024, 512, 256, 256, 512, 512]
    assert int(opt.hysteresis_left.numpy()) == 0
    assert float(opt.scale.numpy()) == 256


def test_fixed_mode_keeps_the_scale_and_still_skips_non_finite_updates() -> None:
    variable = keras.Variable(np.ones((2,), np.float32))
    opt = HalfwayLossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=128.0, growth_steps=1, dynamic=False
    )
    opt.build([variable])
    pattern = "..i.n...i"
    for c in pattern:
        before = variable.numpy().copy()
        grad = {"i": np.inf, "n": np.nan}.get(c, 64.0)
        opt.apply([tf.constant(np.full((2,), grad, np.float32))], [variable])
        assert float(opt.scale.numpy()) == 128.0
        if c == ".":
            # Unscaled: 64 / 128 times the learning rate.
            np.testing.assert_allclose(variable.numpy(), before - 0.1 * 0.5)
        else:
            np.testing.assert_array_equal(variable.numpy(), before)
    assert int(opt.iterations.numpy()) == pattern.count(".")


def test_non_finite_step_leaves_weights_and_optimizer_state_unchanged() -> None:
    variables, _ = twin_variables()
    opt = HalfwayLossScaleOptimizer(keras.optimizers.Adam(0.01), growth_steps=3)
    opt.build(variables)
    steps = gradient_steps("..n")
    for grads in steps[:2]:
        opt.apply([tf.constant(g) for g in grads], variables)
    inner_before = values(opt.inner_optimizer.variables)
    weights_before = values(variables)
    opt.apply([tf.constant(g) for g in steps[2]], variables)
    for a, b in zip(weights_before, values(variables), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(inner_before, values(opt.inner_optimizer.variables), strict=True):
        np.testing.assert_array_equal(a, b)  # Adam's moments and iteration count too
    assert float(opt.scale.numpy()) == 2.0**14
    assert int(opt.step_counter.numpy()) == 0


def test_config_round_trips_every_knob() -> None:
    opt = HalfwayLossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        initial_scale=256.0,
        growth_steps=7,
        growth_factor=3.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=2.0**12,
        hysteresis=4,
        dynamic=False,
    )
    clone = HalfwayLossScaleOptimizer.from_config(opt.get_config())
    for knob in (
        "initial_scale",
        "growth_steps",
        "growth_factor",
        "backoff_factor",
        "min_scale",
        "max_scale",
        "hysteresis",
        "dynamic",
    ):
        assert getattr(clone, knob) == getattr(opt, knob), knob


@pytest.mark.parametrize(
    "knobs",
    [
        {"growth_factor": 1.0},
        {"backoff_factor": 1.0},
        {"hysteresis": 0},
        {"min_scale": 2.0, "initial_scale": 1.0},
        {"max_scale": 2.0**10},
    ],
    ids=str,
)
def test_knobs_that_cannot_work_are_refused(knobs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        HalfwayLossScaleOptimizer(keras.optimizers.SGD(0.1), **knobs)


def test_make_scaler_maps_each_mode_and_passes_every_knob(tmp_path: Path) -> None:
    knobs = {
        "initial_scale": 64.0,
        "growth_steps": 9,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "min_scale": 2.0,
        "max_scale": 4096.0,
        "hysteresis": 3,
    }
    made = {
        mode: make_scaler(
            keras.optimizers.SGD(0.1),
            job_spec(tmp_path, loss_scale={"mode": mode, **knobs})["loss_scale"],
        )
        for mode in ("dynamic", "fixed", "none")
    }
    assert made["none"] is None
    dynamic, fixed = made["dynamic"], made["fixed"]
    assert dynamic is not None and dynamic.dynamic
    assert fixed is not None and not fixed.dynamic
    for knob, value in knobs.items():
        assert getattr(dynamic, knob) == value, knob


class Drain(keras.callbacks.Callback):  # type: ignore[misc]
    """Drains the recorder after each execution, as StepStream does."""

    def __init__(self, recorder: StepRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.batches: list[Drained] = []

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.batches.append(self.recorder.drain())

    def column(self, name: str) -> np.ndarray:
        return np.concatenate([getattr(d, name) for d in self.batches])


def test_none_mode_applies_every_update_and_records_scale_one(tmp_path: Path) -> None:
    spec = job_spec(tmp_path, loss_scale={"mode": "none"}, faults={"nonfinite_at_steps": [1]})
    built = build_trainer(spec, (8,), 3, steps_per_execution=1)
    assert built.scaler is None
    x, y = np.ones((48, 8), np.float32), np.zeros((48,), np.int32)
    drain = Drain(built.recorder)
    built.trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[drain])
    assert drain.column("scale").tolist() == [1.0, 1.0, 1.0]
    # Nothing skips the injected inf: the update is applied and the weights are ruined.
    assert drain.column("finite").tolist() == [True, False, False]
    assert int(built.optimizer.iterations.numpy()) == 3
    assert not all(np.isfinite(w.numpy()).all() for w in built.model.trainable_weights)


def tiny_batches(steps: int, seed: int = 0) -> tf.data.Dataset:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * 16, 8)).astype(np.float32)
    y = rng.integers(0, 3, steps * 16).astype(np.int32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def state_of(built: Built) -> list[np.ndarray]:
    return values(built.model.variables) + values(built.trainer.optimizer.variables)


def test_checkpoint_restores_scale_good_steps_and_hysteresis_into_a_fresh_twin(
    tmp_path: Path,
) -> None:
    knobs = {"initial_scale": 1024, "growth_steps": 4, "hysteresis": 2}
    faults = [1, 2, 3, 8, 11]
    spec = job_spec(tmp_path, loss_scale=knobs, faults={"nonfinite_at_steps": faults})
    keras.utils.set_random_seed(1)
    original = build_trainer(spec, (8,), 3, steps_per_execution=3)
    first = Drain(original.recorder)
    original.trainer.fit(tiny_batches(10), verbose=0, shuffle=False, callbacks=[first])
    state = scaler_state(original.trainer.optimizer)
    # Steps 0-9 leave every part of the state away from its default: backed off twice,
    # grew once (refilling the budget), spent one unit on step 8, one good step since.
    assert state == {"scale": 512.0, "good_steps": 1, "hysteresis_left": 1}

    Checkpointer(tmp_path).save(original.trainer, 10)
    keras.utils.set_random_seed(2)  # different initial weights, so the restore must do it all
    twin = build_trainer(spec, (8,), 3, steps_per_execution=3)
    assert scaler_state(twin.trainer.optimizer) != state
    Checkpointer(tmp_path).restore(twin.trainer, 10)
    twin.recorder.set_start(10)
    assert scaler_state(twin.trainer.optimizer) == state
    for pair in zip(state_of(original), state_of(twin), strict=True):
        np.testing.assert_array_equal(*pair)

    drains = {}
    for name, built in (("original", original), ("twin", twin)):
        drains[name] = Drain(built.recorder)
        built.trainer.fit(
            tiny_batches(10, seed=3), verbose=0, shuffle=False, callbacks=[drains[name]]
        )
    for column in ("loss", "scale", "finite"):
        np.testing.assert_array_equal(
            drains["original"].column(column), drains["twin"].column(column), err_msg=column
        )
    for pair in zip(state_of(original), state_of(twin), strict=True):
        np.testing.assert_array_equal(*pair)
    # And the whole 20-step sequence is the rules' sequence: at step 11 the restored budget
    # of 1 is spent at once, where a fresh scaler would still have tolerated the overflow.
    finite = np.concatenate([first.column("finite"), drains["twin"].column("finite")]).tolist()
    assert [s for s, ok in enumerate(finite) if not ok] == faults
    scales = np.concatenate([first.column("scale"), drains["twin"].column("scale")])
    assert scales.tolist() == expected_scales(finite, initial=1024, growth_steps=4, hysteresis=2)
    assert scales[12] == scales[11] / 2


def test_resumed_job_continues_the_uninterrupted_sequence_without_gap_or_duplicate(
    tmp_path: Path,
) -> None:
    spec = job_spec(
        tmp_path,
        loss_scale={"initial_scale": 1024, "growth_steps": 4, "hysteresis": 2},
        faults={"nonfinite_at_steps": [3, 10, 11, 12, 30, 31, 50]},
        training={"epochs": 3, "checkpoint_every": 10},
        model={"dropout": 0.25},  # resuming must continue the dropout masks too
        outputs={"save_model": True},
    )
    whole = run_job(spec, tmp_path / "whole")
    assert whole.status == "succeeded", whole.error
    total = 3 * 23
    assert whole.steps == list(range(total))

    first = run_job(spec, tmp_path / "resumed", stop_after_step=27)
    assert first.status == "cancelled", first.error
    checkpoint = first.of_type("checkpoint")[-1]["step"]  # type: ignore[typeddict-item]
    assert 27 < checkpoint < total
    assert first.steps == list(range(checkpoint))  # every step that ran, and only those

    # The supervisor passes the acknowledged checkpoint; here, the last one the run sent.
    second = run_job(spec, tmp_path / "resumed", resume_step=checkpoint)
    assert second.status == "succeeded", second.error
    assert second.started["start_step"] == checkpoint
    assert second.steps[0] == checkpoint
    steps = first.steps + second.steps
    assert steps == list(range(total))  # no gap, no duplicate
    # Same seed, same batch order, same state: the resumed run is the uninterrupted one,
    # bit for bit (loss, scale, finite flag and epoch of every step).
    assert first.records + second.records == whole.records
    resumed_model = keras.saving.load_model(tmp_path / "resumed" / "model.keras")
    whole_model = keras.saving.load_model(tmp_path / "whole" / "model.keras")
    for a, b in zip(resumed_model.weights, whole_model.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
