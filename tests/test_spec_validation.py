"""The job spec: a table of valid and invalid specs through the real API. Every invalid one is
a 422 that names the field and the rule, and stores nothing."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import Api

VALID: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (case, spec, expected parts of the normalized spec)
    (
        "defaults: the classic example",
        {},
        {"precision.policy": "mixed_float16", "loss_scale.mode": "dynamic"},
    ),
    (
        "dtype pair float32+float16 is mixed_float16",
        {"precision": {"policy": {"variable_dtype": "float32", "compute_dtype": "float16"}}},
        {"precision.policy": "mixed_float16"},
    ),
    (
        "the seeds' Policy('custom', {...}) form",
        {
            "precision": {
                "policy": {
                    "name": "custom",
                    "variable_dtype": "float32",
                    "compute_dtype": "bfloat16",
                }
            }
        },
        {"precision.policy": "mixed_bfloat16", "loss_scale.mode": "none"},
    ),
    (
        "same dtype pair is the plain policy",
        {"precision": {"policy": {"variable_dtype": "float32", "compute_dtype": "float32"}}},
        {"precision.policy": "float32"},
    ),
    ("auto is none for float32", {"precision": {"policy": "float32"}}, {"loss_scale.mode": "none"}),
    (
        "legacy dynamic=false is fixed",
        {"loss_scale": {"dynamic": False}},
        {"loss_scale.mode": "fixed", "loss_scale.dynamic": None},
    ),
    (
        "scaler knobs",
        {
            "loss_scale": {
                "mode": "dynamic",
                "initial_scale": 1024,
                "growth_steps": 10,
                "growth_factor": 4,
                "backoff_factor": 0.25,
                "min_scale": 2,
                "max_scale": 65536,
                "hysteresis": 3,
            }
        },
        {"loss_scale.hysteresis": 3, "loss_scale.growth_factor": 4.0},
    ),
    (
        "graph rewrite with float32",
        {"precision": {"policy": "float32", "graph_rewrite": True}},
        {"precision.graph_rewrite": True},
    ),
    (
        "keras dataset with matching mlp",
        {"data": {"kind": "keras", "name": "cifar10"}, "model": {"input_size": 3072}},
        {"data.name": "cifar10"},
    ),
    (
        "sgd with momentum",
        {"optimizer": {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True}},
        {"optimizer.momentum": 0.9},
    ),
    (
        "faults are sorted and unique",
        {"faults": {"nonfinite_at_steps": [9, 3, 3]}},
        {"faults.nonfinite_at_steps": [3, 9]},
    ),
    ("resources gpus 0", {"resources": {"gpus": 0}}, {"resources.gpus": 0}),
]

INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    # (case, spec, field, rule)
    (
        "float16 variables with float32 compute",
        {"precision": {"policy": {"variable_dtype": "float16", "compute_dtype": "float32"}}},
        "precision.policy",
        "unexpressible_policy",
    ),
    (
        "float32 variables with float64 compute",
        {"precision": {"policy": {"variable_dtype": "float32", "compute_dtype": "float64"}}},
        "precision.policy",
        "unexpressible_policy",
    ),
    (
        "pair missing compute_dtype",
        {"precision": {"policy": {"variable_dtype": "float32"}}},
        "precision.policy",
        "dtype_pair",
    ),
    (
        "unknown policy name",
        {"precision": {"policy": "mixed_float8"}},
        "precision.policy",
        "literal_error",
    ),
    ("unknown top-level field", {"epochs": 3}, "epochs", "extra_forbidden"),
    ("unknown nested field", {"training": {"epoch": 3}}, "training.epoch", "extra_forbidden"),
    (
        "zero initial scale",
        {"loss_scale": {"initial_scale": 0}},
        "loss_scale.initial_scale",
        "greater_than_equal",
    ),
    (
        "negative initial scale",
        {"loss_scale": {"initial_scale": -8}},
        "loss_scale.initial_scale",
        "greater_than_equal",
    ),
    (
        "absurd initial scale",
        {"loss_scale": {"initial_scale": 1e300}},
        "loss_scale.initial_scale",
        "less_than_equal",
    ),
    (
        "zero growth steps",
        {"loss_scale": {"growth_steps": 0}},
        "loss_scale.growth_steps",
        "greater_than_equal",
    ),
    (
        "growth factor 1",
        {"loss_scale": {"growth_factor": 1}},
        "loss_scale.growth_factor",
        "greater_than",
    ),
    (
        "backoff factor 1",
        {"loss_scale": {"backoff_factor": 1}},
        "loss_scale.backoff_factor",
        "less_than",
    ),
    (
        "hysteresis 0",
        {"loss_scale": {"hysteresis": 0}},
        "loss_scale.hysteresis",
        "greater_than_equal",
    ),
    (
        "initial scale above max",
        {"loss_scale": {"initial_scale": 2**20, "max_scale": 2**16}},
        "loss_scale",
        "scale_bounds",
    ),
    (
        "min above max",
        {"loss_scale": {"min_scale": 8, "max_scale": 4, "initial_scale": 4}},
        "loss_scale",
        "scale_bounds",
    ),
    ("unknown mode", {"loss_scale": {"mode": "static"}}, "loss_scale.mode", "literal_error"),
    (
        "dynamic flag against mode",
        {"loss_scale": {"dynamic": False, "mode": "dynamic"}},
        "loss_scale",
        "conflicting_mode",
    ),
    (
        "graph rewrite with a mixed policy",
        {"precision": {"graph_rewrite": True}},
        "precision",
        "graph_rewrite_conflict",
    ),
    (
        "the old environment variable",
        {"TF_ENABLE_AUTO_MIXED_PRECISION": "1"},
        "TF_ENABLE_AUTO_MIXED_PRECISION",
        "legacy_env_var",
    ),
    (
        "the old environment variable under env",
        {"env": {"TF_ENABLE_AUTO_MIXED_PRECISION": "1"}},
        "TF_ENABLE_AUTO_MIXED_PRECISION",
        "legacy_env_var",
    ),
    ("zero epochs", {"training": {"epochs": 0}}, "training.epochs", "greater_than_equal"),
    ("a billion epochs", {"training": {"epochs": 10**9}}, "training.epochs", "less_than_equal"),
    (
        "batch of 10**9",
        {"training": {"batch_size": 10**9}},
        "training.batch_size",
        "less_than_equal",
    ),
    (
        "validation split 0.9",
        {"training": {"validation_split": 0.9}},
        "training.validation_split",
        "less_than_equal",
    ),
    ("string for int", {"training": {"epochs": "many"}}, "training.epochs", "int_type"),
    ("unknown data kind", {"data": {"kind": "s3"}}, "data", "unknown_kind"),
    ("synthetic samples 1", {"data": {"samples": 1}}, "data.samples", "greater_than_equal"),
    (
        "unknown keras dataset",
        {"data": {"kind": "keras", "name": "imagenet"}},
        "data.name",
        "literal_error",
    ),
    (
        "npz path escapes",
        {"data": {"kind": "npz", "path": "../../etc/passwd.npz"}},
        "data.path",
        "outside_data_dir",
    ),
    (
        "npz absolute path",
        {"data": {"kind": "npz", "path": "/etc/x.npz"}},
        "data.path",
        "outside_data_dir",
    ),
    ("npz missing file", {"data": {"kind": "npz", "path": "nope.npz"}}, "data.path", "not_found"),
    ("npz not an npz", {"data": {"kind": "npz", "path": "x.csv"}}, "data.path", "npz"),
    (
        "model vs data features",
        {"model": {"input_size": 100}},
        "model.input_size",
        "shape_mismatch",
    ),
    ("model vs data classes", {"model": {"num_classes": 5}}, "model.num_classes", "shape_mismatch"),
    (
        "mlp on cifar10 with mnist's input size",
        {"data": {"kind": "keras", "name": "cifar10"}},
        "model.input_size",
        "shape_mismatch",
    ),
    (
        "a model of 10**12 parameters",
        {
            "model": {"input_size": 1_000_000, "hidden": [65536] * 20},
            "data": {"features": 1_000_000, "samples": 2},
        },
        "model",
        "limit",
    ),
    ("unknown model kind", {"model": {"kind": "resnet"}}, "model", "unknown_kind"),
    ("unknown optimizer", {"optimizer": {"name": "lamb"}}, "optimizer.name", "literal_error"),
    (
        "momentum on adam",
        {"optimizer": {"momentum": 0.9}},
        "optimizer",
        "argument_not_for_optimizer",
    ),
    (
        "learning rate zero",
        {"optimizer": {"learning_rate": 0}},
        "optimizer.learning_rate",
        "greater_than",
    ),
    (
        "negative fault step",
        {"faults": {"nonfinite_at_steps": [-1]}},
        "faults.nonfinite_at_steps.0",
        "greater_than_equal",
    ),
    ("gpus -1", {"resources": {"gpus": -1}}, "resources.gpus", "gpu_range"),
    ("priority 101", {"priority": 101}, "priority", "less_than_equal"),
    ("empty name", {"name": ""}, "name", "string_too_short"),
]


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d[part]
    return d


@pytest.mark.parametrize(("case", "spec", "expected"), VALID, ids=[v[0] for v in VALID])
def test_valid_spec_is_normalized(
    api: Api, case: str, spec: dict[str, Any], expected: dict[str, Any]
) -> None:
    r = api.post("/v1/jobs?dry_run=true", json=spec)
    assert r.status_code == 200, r.text
    normalized = r.json()["spec"]
    for dotted, value in expected.items():
        assert _get(normalized, dotted) == value, dotted


@pytest.mark.parametrize(("case", "spec", "field", "rule"), INVALID, ids=[v[0] for v in INVALID])
def test_invalid_spec_is_422_naming_field_and_rule(
    api: Api, case: str, spec: dict[str, Any], field: str, rule: str
) -> None:
    r = api.post("/v1/jobs", json=spec)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "validation_error"
    pairs = [(f["field"], f["rule"]) for f in body["fields"]]
    assert (field, rule) in pairs, pairs
    assert all(f["message"] for f in body["fields"])
    assert api.get("/v1/jobs").json()["items"] == []  # nothing stored


def test_nan_and_infinity_in_json_are_refused(api: Api) -> None:
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"loss_scale": {{"initial_scale": {literal}}}}}'
        r = api.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["fields"][0]["field"] == "loss_scale.initial_scale"


def test_malformed_json_is_422(api: Api) -> None:
    r = api.post(
        "/v1/jobs", content=b'{"precision": ', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422
    assert r.json()["error"] == "validation_error"


def test_float16_without_loss_scaling_is_accepted_with_a_warning(api: Api) -> None:
    r = api.post("/v1/jobs", json={"loss_scale": {"mode": "none"}})
    assert r.status_code == 201, r.text
    warnings = r.json()["warnings"]
    assert any("float16 compute without loss scaling" in w for w in warnings)


def test_legacy_forms_are_explained_in_notes(api: Api) -> None:
    r = api.post(
        "/v1/jobs?dry_run=true",
        json={
            "loss_scale": {"dynamic": False},
            "precision": {"policy": {"variable_dtype": "float32", "compute_dtype": "float16"}},
        },
    )
    notes = " ".join(r.json()["notes"])
    assert "maps to loss_scale.mode 'fixed'" in notes
    assert "dynamic=False" in notes


def test_legacy_env_var_error_explains_the_mapping(api: Api) -> None:
    r = api.post("/v1/jobs", json={"TF_ENABLE_AUTO_MIXED_PRECISION": "1"})
    message = r.json()["fields"][0]["message"]
    assert "does nothing in TensorFlow 2" in message
    assert "graph_rewrite" in message and "auto_mixed_precision" in message


def test_limits_name_the_setting(api: Api) -> None:
    r = api.post(
        "/v1/jobs",
        json={
            "model": {"input_size": 1_000_000, "hidden": [65536] * 20},
            "data": {"features": 1_000_000, "samples": 2},
        },
    )
    assert "HALFWAY_MAX_PARAMETERS" in r.json()["message"]
