"""Plain JSON specs beyond classification with a constant rate: each built-in loss (with its
common arguments), named metrics, every learning-rate schedule with a warm-up, regression
targets in an .npz, and a folder of class sub-folders of images. Each trains for real on the
CPU (in this process, through the real schema and normalization)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.settings import Settings
from service.specs.normalization import normalize
from service.specs.schemas import JobSpec
from tests.conftest import Api
from tests.training_runs import Run, run_job

pytestmark = pytest.mark.keras


def spec_of(tmp_path: Path, body: dict[str, Any]) -> dict[str, Any]:
    body = {"outputs": {"save_model": False}, "precision": {"policy": "float32"}, **body}
    result = normalize(JobSpec.model_validate(body), Settings(home=tmp_path / "home"))
    spec: dict[str, Any] = result.spec.model_dump(mode="json")
    return spec


def data_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "home" / "data"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def train(tmp_path: Path, body: dict[str, Any]) -> Run:
    run = run_job(spec_of(tmp_path, body), data_dir(tmp_path) / "job")
    assert run.status == "succeeded", run.error
    return run


def epoch_metrics(run: Run) -> list[dict[str, float]]:
    out: list[dict[str, float]] = []
    for m in run.of_type("metrics"):
        message: dict[str, Any] = dict(m)
        if message["epoch"] >= 0:
            out.append(dict(message["metrics"]))
    return out


def falls(run: Run) -> None:
    losses = [r[2] for r in run.records]
    assert all(math.isfinite(v) for v in losses)
    per_epoch = epoch_metrics(run)
    assert per_epoch[-1]["loss"] < 0.8 * per_epoch[0]["loss"], per_epoch


CLASSIFY: dict[str, Any] = {
    "data": {"kind": "synthetic", "samples": 512, "features": 8, "classes": 3, "separation": 6},
    "model": {"input_size": 8, "hidden": [16], "num_classes": 3},
    "optimizer": {"learning_rate": 0.01},
    "training": {"epochs": 6, "batch_size": 32},
}


def regression_npz(tmp_path: Path, outputs: int = 1) -> str:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 6)).astype(np.float32)
    w = rng.normal(size=(6, outputs)).astype(np.float32)
    y = x @ w + 0.05 * rng.normal(size=(512, outputs)).astype(np.float32)
    np.savez(
        data_dir(tmp_path) / "regression.npz", x_train=x, y_train=y[:, 0] if outputs == 1 else y
    )
    return "regression.npz"


REGRESSION: dict[str, Any] = {
    "model": {"input_size": 6, "hidden": [16], "num_classes": 1},
    "optimizer": {"learning_rate": 0.01},
    "training": {"epochs": 6, "batch_size": 32},
}


@pytest.mark.parametrize(
    "loss",
    [
        "sparse_categorical_crossentropy",
        {"name": "sparse_categorical_crossentropy", "from_logits": False},
        {"name": "categorical_crossentropy", "label_smoothing": 0.1},
    ],
)
def test_classification_losses_train(tmp_path: Path, loss: Any) -> None:
    run = train(tmp_path, {**CLASSIFY, "training": {**CLASSIFY["training"], "loss": loss}})
    falls(run)
    assert epoch_metrics(run)[-1]["accuracy"] > 0.8


def test_binary_crossentropy_on_two_classes_with_one_sigmoid_output(tmp_path: Path) -> None:
    body = {
        "data": {"kind": "synthetic", "samples": 512, "features": 8, "classes": 2, "separation": 6},
        "model": {"input_size": 8, "hidden": [16], "num_classes": 1},
        "optimizer": {"learning_rate": 0.01},
        "training": {
            "epochs": 6,
            "batch_size": 32,
            "loss": {"name": "binary_crossentropy", "label_smoothing": 0.05},
            "metrics": ["accuracy", "auc"],
        },
    }
    run = train(tmp_path, body)
    falls(run)
    last = epoch_metrics(run)[-1]
    assert last["accuracy"] > 0.8 and last["auc"] > 0.9
    (head,) = [p for p in run.started["precision_report"] if p["layer"] == "predictions"]
    assert head["class"] == "Activation"


@pytest.mark.parametrize("loss", ["mse", "mae", {"name": "huber", "delta": 0.5}, "log_cosh"])
def test_regression_losses_on_npz_targets(tmp_path: Path, loss: Any) -> None:
    path = regression_npz(tmp_path)
    body = {
        **REGRESSION,
        "data": {"kind": "npz", "path": path},
        "training": {**REGRESSION["training"], "loss": loss, "metrics": ["mae", "rmse"]},
    }
    run = train(tmp_path, body)
    falls(run)
    last = epoch_metrics(run)[-1]
    assert {"mae", "rmse"} <= set(last)
    assert "accuracy" not in last  # no accuracy for a regression


def test_multi_output_regression_with_mse(tmp_path: Path) -> None:
    path = regression_npz(tmp_path, outputs=3)
    body = {
        "model": {"input_size": 6, "hidden": [16], "num_classes": 3},
        "optimizer": {"learning_rate": 0.01},
        "data": {"kind": "npz", "path": path},
        "training": {"epochs": 6, "batch_size": 32, "loss": "mse"},
    }
    falls(train(tmp_path, body))


SCHEDULES: list[dict[str, Any]] = [
    {"kind": "constant", "warmup_steps": 20},
    {"kind": "cosine_decay", "decay_steps": 60, "alpha": 0.1, "warmup_steps": 10},
    {"kind": "exponential_decay", "decay_steps": 20, "decay_rate": 0.5, "staircase": True},
    {
        "kind": "piecewise_constant",
        "boundaries": [30, 60],
        "values": [0.02, 0.01, 0.002],
        "warmup_steps": 5,
    },
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=[s["kind"] for s in SCHEDULES])
def test_learning_rate_schedules_train_and_follow_their_formula(
    tmp_path: Path, schedule: dict[str, Any]
) -> None:
    from workers.losses import build_schedule

    body = {**CLASSIFY, "optimizer": {"learning_rate": 0.02, "schedule": schedule}}
    spec = spec_of(tmp_path, body)
    rate = build_schedule(spec["optimizer"])
    assert not isinstance(rate, float)
    at = {s: float(rate(s)) for s in (0, 4, 9, 19, 29, 45, 59, 80)}
    warm = schedule.get("warmup_steps", 0)
    peak = schedule["values"][0] if schedule["kind"] == "piecewise_constant" else 0.02
    for step, value in at.items():
        if step < warm:
            expected = peak * (step + 1) / warm
        else:
            t = step - warm
            if schedule["kind"] == "constant":
                expected = 0.02
            elif schedule["kind"] == "cosine_decay":
                frac = min(t, 60) / 60
                expected = 0.02 * ((1 - 0.1) * 0.5 * (1 + math.cos(math.pi * frac)) + 0.1)
            elif schedule["kind"] == "exponential_decay":
                expected = 0.02 * 0.5 ** (t // 20)
            else:
                expected = 0.02 if t <= 30 else (0.01 if t <= 60 else 0.002)
        assert value == pytest.approx(expected, rel=1e-4), (step, at)
    falls(train(tmp_path, body))


def write_images(folder: Path, per_class: int = 24) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, level in (("dark", 40), ("light", 210)):
        (folder / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.clip(rng.normal(level, 30, size=(10, 12)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(folder / label / f"{i}.png")


def test_image_directory_trains_a_cnn_with_a_validation_split(tmp_path: Path) -> None:
    write_images(data_dir(tmp_path) / "shades")
    body = {
        "data": {
            "kind": "image_directory",
            "path": "shades",
            "image_size": [8, 8],
            "color_mode": "grayscale",
            "validation_split": 0.25,
        },
        "model": {
            "kind": "cnn",
            "input_shape": [8, 8, 1],
            "filters": [4],
            "dense": 8,
            "num_classes": 2,
        },
        "optimizer": {"learning_rate": 0.01},
        "training": {"epochs": 8, "batch_size": 8},
    }
    run = train(tmp_path, body)
    # 48 images, a quarter held out: 36 to train on, 5 batches of 8 per epoch.
    assert run.started["steps_per_epoch"] == 5
    last = epoch_metrics(run)[-1]
    assert last["val_accuracy"] == 1.0 and "val_loss" in last


def test_image_directory_is_checked_at_submission(api: Api, settings: Settings) -> None:
    folder = settings.resolved_data_dir() / "shades"
    body: dict[str, Any] = {
        "data": {
            "kind": "image_directory",
            "path": "shades",
            "image_size": [8, 8],
            "color_mode": "grayscale",
        },
        "model": {"kind": "cnn", "input_shape": [8, 8, 1], "num_classes": 2},
    }
    r = api.post("/v1/jobs?dry_run=true", json=body)
    assert r.status_code == 422 and r.json()["fields"][0]["rule"] == "not_found", r.text
    (folder / "only").mkdir(parents=True)
    r = api.post("/v1/jobs?dry_run=true", json=body)
    assert r.status_code == 422 and r.json()["fields"][0]["rule"] == "classes", r.text
    (folder / "other").mkdir()
    assert api.post("/v1/jobs?dry_run=true", json=body).status_code == 200
    body["model"]["num_classes"] = 3
    r = api.post("/v1/jobs?dry_run=true", json=body)
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "model.num_classes"
    body["model"] = {"kind": "cnn", "input_shape": [8, 8, 3], "num_classes": 2}
    r = api.post("/v1/jobs?dry_run=true", json=body)
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "model.input_shape"
    r = api.post("/v1/jobs?dry_run=true", json={**body, "data": {**body["data"], "path": "../x"}})
    assert r.status_code == 422 and r.json()["fields"][0]["rule"] == "outside_data_dir"


@pytest.mark.parametrize(
    ("section", "value", "field", "rule"),
    [
        ("training", {"loss": "hinge"}, "training.loss.name", "literal_error"),
        (
            "training",
            {"loss": {"name": "mse", "from_logits": True}},
            "training.loss",
            "argument_not_for_loss",
        ),
        (
            "training",
            {"loss": {"name": "sparse_categorical_crossentropy", "label_smoothing": 0.1}},
            "training.loss",
            "argument_not_for_loss",
        ),
        ("training", {"metrics": ["f1"]}, "training.metrics.0", "literal_error"),
        ("optimizer", {"schedule": {"kind": "cosine_decay"}}, "optimizer.schedule", "missing"),
        (
            "optimizer",
            {"schedule": {"kind": "piecewise_constant", "boundaries": [5, 3], "values": [1, 2, 3]}},
            "optimizer.schedule",
            "boundaries",
        ),
        (
            "optimizer",
            {"schedule": {"kind": "constant", "decay_steps": 3}},
            "optimizer.schedule",
            "argument_not_for_schedule",
        ),
        ("model", {"num_classes": 1}, "model.num_classes", "too_small"),
    ],
)
def test_bad_loss_metric_and_schedule_are_422s_naming_the_field(
    api: Api, section: str, value: dict[str, Any], field: str, rule: str
) -> None:
    r = api.post("/v1/jobs?dry_run=true", json={section: value})
    assert r.status_code == 422, r.text
    (problem,) = r.json()["fields"]
    assert (problem["field"], problem["rule"]) == (field, rule), problem


def test_an_uploaded_npz_of_regression_targets_is_accepted_for_mse(api: Api) -> None:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    x = rng.normal(size=(40, 3)).astype(np.float32)
    np.savez(buffer, x_train=x, y_train=x.sum(axis=1))
    r = api.post("/v1/datasets", files={"file": ("r.npz", buffer.getvalue())}, data={"name": "r"})
    assert r.status_code == 201, r.text
    assert r.json()["arrays"]["y_train"] == {"shape": [40], "dtype": "float32"}
    spec = {
        "data": {"kind": "npz", "path": r.json()["path"]},
        "model": {"input_size": 3, "num_classes": 1},
        "training": {"loss": "mse"},
    }
    assert api.post("/v1/jobs?dry_run=true", json=spec).status_code == 200


def test_float_targets_with_a_classification_loss_fail_the_job_clearly(tmp_path: Path) -> None:
    path = regression_npz(tmp_path)
    body = {**REGRESSION, "data": {"kind": "npz", "path": path}}
    body["model"] = {**REGRESSION["model"], "num_classes": 2}
    run = run_job(spec_of(tmp_path, body), data_dir(tmp_path) / "job")
    assert run.status is None
    assert run.error is not None and "y_train must be integer class labels" in run.error
