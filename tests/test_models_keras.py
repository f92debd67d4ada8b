"""Bring your own model, presets, forensics, sweeps and TensorBoard, with real Keras on CPU:
jobs submitted through the API and run by the supervisor in spawned training children."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.database.db import Database
from service.settings import Settings
from tests.conftest import Api
from tests.test_training_keras import all_history, submit
from workers.supervisor import Supervisor

pytestmark = pytest.mark.keras


def run_all(db: Database, settings: Settings) -> None:
    sup = Supervisor(db, settings)
    while sup.run_once():
        pass


def job(api: Api, job_id: int) -> dict[str, Any]:
    body: dict[str, Any] = api.get(f"/v1/jobs/{job_id}").json()
    return body


def functional_config() -> dict[str, Any]:
    import keras

    inputs = keras.Input((16,))
    x = keras.layers.Dense(12, activation="relu", name="hidden")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    outputs = keras.layers.Dense(4, activation="softmax", name="out")(x)
    config: dict[str, Any] = json.loads(keras.Model(inputs, outputs).to_json())
    return config


DATA16 = {"samples": 320, "features": 16, "classes": 4}


def test_a_functional_model_config_trains_under_the_jobs_policy(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = submit(
        api,
        {
            "model": {"kind": "keras", "config": functional_config()},
            "data": DATA16,
            "training": {"epochs": 2, "batch_size": 32},
        },
    )
    run_all(db, settings)
    done = job(api, job_id)
    assert done["status"] == "succeeded", done["error"]
    report = {r["layer"]: r for r in done["precision_report"]}
    # The config says float32 on every layer; the job's mixed_float16 policy wins...
    assert report["hidden"]["compute_dtype"] == "float16"
    assert report["hidden"]["variable_dtype"] == "float32"
    # ...and the output layer runs in float32, as output_float32 asks.
    assert report["out"]["output_dtype"] == "float32"
    assert len(all_history(api, job_id)) == 20
    assert (settings.resolved_artifact_dir() / str(job_id) / "model.keras").is_file()


def test_a_config_keras_refuses_is_a_clear_job_error(
    api: Api, db: Database, settings: Settings
) -> None:
    config = functional_config()
    for layer in config["config"]["layers"]:
        if layer["class_name"] == "Dense":
            layer["config"]["unitz"] = 3  # passes the API's safety check, not Keras
    job_id = submit(api, {"model": {"kind": "keras", "config": config}, "data": DATA16})
    run_all(db, settings)
    done = job(api, job_id)
    assert done["status"] == "failed" and done["attempt"] == 1  # not retried
    assert "Keras could not build model.config" in done["error"]


def test_a_config_over_the_parameter_limit_fails_before_training(
    api: Api, db: Database, settings: Settings
) -> None:
    settings.max_parameters = 100
    job_id = submit(
        api, {"model": {"kind": "keras", "config": functional_config()}, "data": DATA16}
    )
    run_all(db, settings)
    done = job(api, job_id)
    assert done["status"] == "failed"
    assert "parameters; the server's limit is 100" in done["error"]
    assert all_history(api, job_id) == []


def test_a_config_whose_input_does_not_fit_the_data_fails_clearly(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = submit(
        api,
        {
            "model": {"kind": "keras", "config": functional_config()},
            "data": {**DATA16, "features": 20},
        },
    )
    run_all(db, settings)
    done = job(api, job_id)
    assert done["status"] == "failed" and "(20 values)" in done["error"]


@pytest.mark.parametrize(
    ("model", "data"),
    [
        (
            {
                "kind": "cnn",
                "input_shape": [8, 8, 1],
                "filters": [4, 8],
                "dense": 16,
                "num_classes": 3,
            },
            {"samples": 192, "features": 64, "classes": 3},
        ),
        (
            {
                "kind": "transformer",
                "sequence_length": 8,
                "features": 4,
                "embed_dim": 16,
                "num_heads": 2,
                "ff_dim": 32,
                "num_layers": 1,
                "num_classes": 3,
            },
            {"samples": 192, "features": 32, "classes": 3},
        ),
    ],
    ids=["cnn", "transformer"],
)
def test_presets_train_on_matching_data_and_learn(
    api: Api, db: Database, settings: Settings, model: dict[str, Any], data: dict[str, Any]
) -> None:
    job_id = submit(
        api, {"model": model, "data": data, "training": {"epochs": 6, "batch_size": 32}}
    )
    run_all(db, settings)
    done = job(api, job_id)
    assert done["status"] == "succeeded", done["error"]
    rows = all_history(api, job_id)
    assert len(rows) == 36
    first, last = np.mean([r["loss"] for r in rows[:6]]), np.mean([r["loss"] for r in rows[-6:]])
    assert last < first


def test_a_preset_on_an_npz_of_the_wrong_shape_fails_clearly(
    api: Api, db: Database, settings: Settings
) -> None:
    np.savez(
        settings.resolved_data_dir() / "seq.npz",
        x_train=np.zeros((40, 5, 5), np.float32),
        y_train=np.zeros((40,), np.int64),
    )
    job_id = submit(
        api,
        {
            "model": {
                "kind": "cnn",
                "input_shape": [8, 8, 1],
                "filters": [4],
                "dense": 8,
                "num_classes": 2,
            },
            "data": {"kind": "npz", "path": "seq.npz"},
        },
    )
    run_all(db, settings)
    done = job(api, job_id)
    assert done["status"] == "failed" and done["attempt"] == 1
    assert "model.input_shape takes samples of shape (8, 8, 1)" in done["error"]


def test_forensics_name_the_variable_whose_gradient_overflowed(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = submit(
        api,
        {
            "data": DATA16,
            "model": {"input_size": 16, "hidden": [8, 8], "num_classes": 4},
            "training": {"epochs": 1, "batch_size": 32, "steps_per_execution": 3},
            "faults": {"nonfinite_at_steps": [4, 7], "nonfinite_variables": ["dense_1/kernel"]},
            "forensics": {"captures": 2},
        },
    )
    run_all(db, settings)
    done = job(api, job_id)
    assert done["status"] == "succeeded", done["error"]
    reports = done["forensics"]
    assert [r["step"] for r in reports] == [4, 7]
    for r in reports:
        assert len(r["nonfinite_variables"]) == 1
        assert r["nonfinite_variables"][0].endswith("dense_1/kernel")
        assert r["variables"] == 6  # two hidden layers and the logits: kernel and bias each
        assert math.isfinite(r["loss"]) and r["loss_scale"] > 0
    rows = all_history(api, job_id)
    assert reports[0]["loss_scale"] == rows[4]["loss_scale"]


def test_three_variant_sweep_compares_measured_values(
    api: Api, db: Database, settings: Settings
) -> None:
    base = {
        "data": {"samples": 2048, "features": 32, "classes": 4, "seed": 5},
        "model": {"input_size": 32, "hidden": [32], "num_classes": 4},
        "training": {"epochs": 3, "batch_size": 32, "seed": 5, "validation_split": 0.1},
    }
    created = api.post(
        "/v1/sweeps",
        json={
            "name": "cmp",
            "base": base,
            "policies": ["float32", "mixed_float16", "mixed_bfloat16"],
            "target_loss": 1.2,
        },
    ).json()
    run_all(db, settings)
    table = api.get(f"/v1/sweeps/{created['id']}").json()
    assert table["done"] is True
    by_policy = {v["policy"]: v for v in table["variants"]}
    assert set(by_policy) == {"float32", "mixed_float16", "mixed_bfloat16"}
    for v in table["variants"]:
        assert v["status"] == "succeeded", v["error"]
        assert v["examples_per_second"] > 0 and v["median_step_seconds"] > 0
        assert v["final_loss"] is not None and "val_loss" in v["final_metrics"]
        assert v["time_to_target_seconds"] is not None and v["step_to_target"] >= 49
        assert v["speedup_vs_float32"] > 0
        assert v["final_loss_scale"] is not None and v["min_loss_scale"] is not None
        assert v["peak_memory_bytes"] is None  # the CPU does not report it
    assert by_policy["float32"]["speedup_vs_float32"] == 1.0
    assert by_policy["mixed_float16"]["loss_scale_mode"] == "dynamic"
    assert by_policy["mixed_float16"]["final_loss_scale"] >= 1.0
    assert by_policy["float32"]["final_loss_scale"] == 1.0  # not scaled: recorded as 1
    # The values are the jobs' own measurements.
    f16 = job(api, by_policy["mixed_float16"]["job_id"])
    assert (
        f16["summary"]["metrics"]["timing"]["median_step_seconds"]
        == by_policy["mixed_float16"]["median_step_seconds"]
    )


def test_tensorboard_scalars_are_readable_by_tensorboard(
    api: Api, db: Database, settings: Settings
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    job_id = submit(
        api,
        {
            "data": DATA16,
            "model": {"input_size": 16, "hidden": [8], "num_classes": 4},
            "training": {"epochs": 1, "batch_size": 32},
            "faults": {"nonfinite_at_steps": [3]},
            "outputs": {"tensorboard": True},
        },
    )
    run_all(db, settings)
    assert job(api, job_id)["status"] == "succeeded"
    folder: Path = settings.resolved_artifact_dir() / str(job_id) / "tensorboard"
    events = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    events.Reload()
    tags = set(events.Tags()["tensors"])
    assert {"loss", "loss_scale", "finite"} <= tags
    rows = all_history(api, job_id)

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, float(make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]

    assert [s for s, _ in series("loss")] == [r["step"] for r in rows]
    assert [v for _, v in series("loss_scale")] == [r["loss_scale"] for r in rows]
    assert [v for _, v in series("finite")] == [1.0 if r["finite"] else 0.0 for r in rows]
    np.testing.assert_allclose([v for _, v in series("loss")], [r["loss"] for r in rows], rtol=1e-6)
