"""The gradient meter against a model whose gradients are known in closed form, and policy
'auto' choosing from the model's own numbers. Real Keras on CPU, in this process.

The model: a zero-initialised bias-free Dense(1) under the job's policy, then a float32
output (the spec's default), trained on MSE against tiny targets. At step 0 the prediction is
exactly 0, so the loss's gradient reaching the Dense layer is ``S * -2 y / B`` per example
(rounded to float16 under mixed_float16, where the output's cast hands it to the float16
layer), and the kernel's float32 gradient is ``g32 = -(2 / B) * x^T y``. Feature j spans
2^(j-8), so at scale 1 some kernel gradients lie above float16's smallest subnormal and most
below.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from service.settings import Settings
from service.specs.normalization import normalize
from service.specs.schemas import JobSpec
from tests.training_runs import Run, run_job
from workers.autoprecision import decide
from workers.data import epoch_indices
from workers.gradients import PLAIN_TRACE_STEPS, GradientMeter
from workers.gradstats import FLOAT16_MIN_SUBNORMAL, LOG2_FLOAT16_MAX

N, D, BATCH, SEED = 64, 16, 32, 7


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = (rng.uniform(0.5, 1.5, (N, D)) * 2.0 ** (np.arange(D) - 8)).astype("float32")
    y = (rng.uniform(1, 4, (N, 1)) * 1e-9).astype("float32")
    return x, y


def _spec(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    x, y = _data()
    data_dir = tmp_path / "home" / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    np.savez(data_dir / "tiny.npz", x_train=x, y_train=y)
    model = keras.Sequential(
        [
            keras.Input((D,)),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
            keras.layers.Activation("linear"),
        ]
    )
    body: dict[str, Any] = {
        "model": {"kind": "keras", "config": json.loads(model.to_json())},
        "data": {"kind": "npz", "path": "tiny.npz"},
        "training": {
            "epochs": 1,
            "batch_size": BATCH,
            "steps_per_execution": 2,
            "seed": SEED,
            "loss": {"name": "mean_squared_error"},
            "metrics": [],
        },
        "optimizer": {"name": "sgd", "learning_rate": 0.01},
        "gradients": {"every": 1, "shadow_every": 1},
        "outputs": {"save_model": False},
    }
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value}
    spec: dict[str, Any] = normalize(
        JobSpec.model_validate(body), Settings(home=tmp_path / "home")
    ).spec.model_dump(mode="json")
    return spec


def _run(tmp_path: Path, spec: dict[str, Any]) -> Run:
    job_dir = tmp_path / "home" / "data" / "job"  # run_job reads data beside the job folder
    run = run_job(spec, job_dir)
    assert run.status == "succeeded", run.error
    return run


def _samples(run: Run) -> list[Any]:
    return [s for m in run.of_type("gradients") for s in m["samples"]]  # type: ignore[typeddict-item]


def _expected(scale: float) -> dict[str, Any]:
    """numpy's account of step 0 (the first batch in Halfway's order for the seed)."""
    x, y = _data()
    first = epoch_indices(N, BATCH, None, SEED, 0)[:BATCH]
    xb, yb = x[first].astype(np.float64), y[first].astype(np.float64)
    g32 = -(2.0 / BATCH) * (xb.T @ yb)[:, 0]
    # What the float16 Dense layer receives, and the kernel gradient it computes from it.
    upstream = (scale * -2.0 * yb / BATCH).astype(np.float32).astype(np.float16)
    g = (xb.astype(np.float16).astype(np.float32).T @ upstream.astype(np.float32))[:, 0]
    g = g.astype(np.float16).astype(np.float32)
    scaled = np.abs(g32) * scale
    # The expectation must not hinge on rounding at the threshold.
    assert np.min(np.abs(scaled / FLOAT16_MIN_SUBNORMAL - 1)) > 0.05
    nonzero = np.abs(g)[g != 0]
    return {
        "zero_share": float(np.mean(g == 0)),
        "underflow_share": float(np.mean(scaled < FLOAT16_MIN_SUBNORMAL)),
        "lost_share": float(np.mean((g == 0) & (g32 != 0))),
        "log2_max": math.log2(float(nonzero.max())) if len(nonzero) else None,
        "log2_min_nonzero": math.log2(float(nonzero.min())) if len(nonzero) else None,
    }


def test_at_scale_one_mixed_float16_flushes_what_numpy_says_and_loses_every_gradient(
    tmp_path: Path,
) -> None:
    spec = _spec(
        tmp_path,
        precision={"policy": "mixed_float16"},
        loss_scale={"mode": "fixed", "initial_scale": 1.0},
    )
    first = _samples(_run(tmp_path, spec))[0]
    want = _expected(1.0)
    assert first["step"] == 0 and first["shadow"] and first["loss_scale"] == 1.0
    assert 0.5 < want["underflow_share"] < 1.0  # most, not all: the figure is not trivial
    assert first["underflow_share"] == pytest.approx(want["underflow_share"])
    # Every upstream gradient flushed, so the kernel's gradient is all zero: all lost.
    assert first["zero_share"] == want["zero_share"] == 1.0
    assert first["lost_share"] == want["lost_share"] == 1.0
    assert first["log2_max"] is None and first["headroom"] is None
    (kernel,) = first["variables"]
    assert kernel["name"].endswith("kernel") and kernel["lost_share"] == 1.0


def test_with_dynamic_scaling_from_2_15_nothing_flushes_and_the_range_is_numpys(
    tmp_path: Path,
) -> None:
    spec = _spec(
        tmp_path,
        precision={"policy": "mixed_float16"},
        loss_scale={"mode": "dynamic", "initial_scale": 2.0**15},
    )
    first = _samples(_run(tmp_path, spec))[0]
    want = _expected(2.0**15)
    assert first["loss_scale"] == 2.0**15
    assert first["underflow_share"] == want["underflow_share"] == 0.0
    assert first["zero_share"] == want["zero_share"] == 0.0
    assert first["lost_share"] == want["lost_share"] == 0.0
    assert first["log2_max"] == pytest.approx(want["log2_max"], abs=0.01)
    assert first["log2_min_nonzero"] == pytest.approx(want["log2_min_nonzero"], abs=0.01)
    assert first["headroom"] == pytest.approx(LOG2_FLOAT16_MAX - want["log2_max"], abs=0.01)
    assert first["relative_error"] < 0.01  # float16 rounding of a well-scaled gradient


def test_a_float32_job_says_what_float16_would_flush_and_loses_nothing(tmp_path: Path) -> None:
    spec = _spec(tmp_path, precision={"policy": "float32"})
    first = _samples(_run(tmp_path, spec))[0]
    assert first["loss_scale"] == 1.0
    assert first["underflow_share"] == pytest.approx(_expected(1.0)["underflow_share"])
    assert first["lost_share"] == 0.0 and first["zero_share"] == 0.0
    assert first["relative_error"] == pytest.approx(0.0, abs=1e-6)


def test_samples_fall_on_their_steps_and_only_shadow_steps_carry_shadow_figures(
    tmp_path: Path,
) -> None:
    spec = _spec(
        tmp_path,
        gradients={"every": 1, "shadow_every": 2},
        training={"epochs": 3},
    )
    samples = _samples(_run(tmp_path, spec))
    assert [s["step"] for s in samples] == list(range(6))
    assert [s["shadow"] for s in samples] == [True, False] * 3
    assert all(s["lost_share"] is None for s in samples if not s["shadow"])
    assert all(s["lost_share"] is not None for s in samples if s["shadow"])


def test_a_short_job_runs_its_metered_step_throughout_and_samples_only_due_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 4-5 and 10-11 are an execution with nothing due: a job this short runs them in
    the metered step it traced at step 0 rather than trace the plain one too, and that step
    samples only the due steps."""
    built: list[keras.Model] = []
    make = keras.Model.make_train_function

    def counted(model: keras.Model, force: bool = False) -> Any:
        built.append(model)
        return make(model, force)

    # Observes (and still calls) Keras's own builder, which traces one step function each.
    monkeypatch.setattr(keras.Model, "make_train_function", counted)
    spec = _spec(tmp_path, gradients={"every": 3, "shadow_every": 6}, training={"epochs": 6})
    run = _run(tmp_path, spec)
    samples = _samples(run)
    assert [s["step"] for s in samples] == [0, 3, 6, 9]
    assert [s["shadow"] for s in samples] == [True, False, True, False]
    assert run.steps == list(range(12))
    assert len(built) == 1


def test_which_step_an_execution_runs() -> None:
    """Sampling decides first; then a job whose plain step is not traced keeps the metered
    one when fewer than PLAIN_TRACE_STEPS remain, never when it is not metering (auto's
    timed probe) or its end is unknown."""
    meter = GradientMeter([], 250, 1000, 64)
    assert meter.metered(0, 64, set()) and meter.metered(192, 64, {True, False})  # 0, 250 due
    assert not meter.metered(64, 64, {True})  # the end unknown: trace the plain step
    meter.ends_at = 64 + PLAIN_TRACE_STEPS
    assert not meter.metered(64, 64, {True})  # far enough from the end to pay for it
    assert meter.metered(65, 64, {True})
    assert not meter.metered(65, 64, {True, False})  # traced already: nothing to save
    meter.active = False
    assert not meter.metered(65, 64, {True}) and not meter.metered(0, 64, set())


def test_the_meters_branch_is_a_function_call_that_runs_only_when_taken() -> None:
    """The meter's cond stays a functional If (TensorFlow lowers a cond in a function to
    switch and merge nodes, whose untaken side every step still walks); a cond built the
    usual way beside it is lowered, so the check can tell the two apart."""
    import tensorflow as tf

    weights = [tf.Variable(tf.ones((3, 2))), tf.Variable(tf.ones((2,)))]
    meter = GradientMeter(weights, 2, 0, 4)

    def measured(count: Any) -> Any:
        grads = [w * 0.5 for w in weights]
        meter.measure(count, tf.constant(1.0), grads, None)
        return tf.cond(count > 0, lambda: count + 1, lambda: count - 1)  # the usual kind

    step = tf.function(measured)
    graph = step.get_concrete_function(tf.TensorSpec((), tf.int64)).graph
    lowered = {
        op.name: bool(op.node_def.attr["_lower_using_switch_merge"].b)
        if "_lower_using_switch_merge" in op.node_def.attr
        else False
        for op in graph.get_operations()
        if op.type in ("If", "StatelessIf")
    }
    assert sorted(lowered.values()) == [False, True], lowered
    # And it samples the due step, and only that one.
    for count in range(4):
        step(tf.constant(count, tf.int64))
    assert [s["step"] for s in meter.drain()] == [0, 2]


def test_the_meter_does_not_change_what_the_run_trains(tmp_path: Path) -> None:
    """The shadow reads the step's state and writes nothing: the same losses with it and
    without it, dropout included."""
    config = keras.Sequential(
        [
            keras.Input((D,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dropout(0.3),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    ).to_json()
    base = {"model": {"kind": "keras", "config": json.loads(config)}}
    on = _spec(tmp_path / "on", gradients={"every": 1, "shadow_every": 1}, **base)
    off = _spec(tmp_path / "off", gradients={"every": 0, "shadow_every": 0}, **base)
    with_meter, without = _run(tmp_path / "on", on), _run(tmp_path / "off", off)
    assert _samples(with_meter) and not _samples(without)
    assert [r[2] for r in with_meter.records] == [r[2] for r in without.records]


def test_an_underflow_alarm_names_the_layer_and_the_guard_fails_the_job(
    tmp_path: Path,
) -> None:
    spec = _spec(
        tmp_path,
        precision={"policy": "mixed_float16"},
        loss_scale={"mode": "fixed", "initial_scale": 1.0},
        gradients={"alarm_samples": 2, "guard": True},
    )
    run = run_job(spec, tmp_path / "home" / "data" / "job")
    (alarm,) = run.of_type("alarm")
    message = str(alarm["message"])  # type: ignore[typeddict-item]
    assert "dense" in message and "initial_scale" in message
    assert run.error is not None and run.error.startswith("guard (gradients.guard)")


def test_auto_does_not_choose_mixed_float16_when_it_would_lose_the_gradients(
    tmp_path: Path,
) -> None:
    spec = _spec(
        tmp_path,
        precision={"policy": "auto", "probe": {"warmup": 2, "steps": 8}},
        loss_scale={"mode": "fixed", "initial_scale": 1.0},
    )
    run = _run(tmp_path, spec)
    (message,) = run.of_type("decision")
    decision = message["decision"]  # type: ignore[typeddict-item]
    probes = {p["policy"]: p for p in decision["probes"]}
    assert decision["policy"] != "mixed_float16"
    assert probes["mixed_float16"]["lost_share"] == 1.0 and not probes["mixed_float16"]["eligible"]
    assert "mixed_float16" in decision["reason"] and "lost" in decision["reason"]
    # The job trains with the choice, and its history holds no probe step.
    assert run.started["precision_report"][0]["policy"] == decision["policy"]
    assert run.steps == list(range(2))


def test_the_rule_picks_the_fastest_tracking_candidate_only_when_it_is_fast_enough() -> None:
    cfg = {"loss_tolerance": 0.05, "max_lost_share": 0.01, "min_speedup": 1.05}

    def probes(bf16: float, f16: float, f16_lost: float = 0.0) -> list[dict[str, Any]]:
        rows = [
            ("float32", 1.0, 0.0),
            ("mixed_bfloat16", bf16, 0.0),
            ("mixed_float16", f16, f16_lost),
        ]
        return [
            {"policy": p, "median_step_seconds": t, "mean_loss": 1.0, "lost_share": lost}
            for p, t, lost in rows
        ]

    assert decide(probes(0.5, 0.4), cfg)["policy"] == "mixed_float16"
    assert decide(probes(0.5, 0.4, f16_lost=0.2), cfg)["policy"] == "mixed_bfloat16"
    assert decide(probes(0.97, 1.2), cfg)["policy"] == "float32"  # 1.03x is not enough
    kept = decide(probes(0.97, 1.2), cfg)
    assert "1.03x" in kept["reason"]
