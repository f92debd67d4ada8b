"""Model kinds at submission: the CNN and Transformer presets checked against the data's shape
and the parameter limit, and Keras model configs checked for what makes them unsafe (Lambda
layers, custom objects, unknown classes) before any worker sees them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import Api


def keras_configs() -> dict[str, dict[str, Any]]:
    """Real model.to_json() output, made by Keras in this process."""
    import keras

    inputs = keras.Input((16,))
    x = keras.layers.Dense(12, activation="relu")(inputs)
    x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(4, activation="softmax")(x)
    functional = keras.Model(inputs, outputs)
    sequential = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)]
    )
    with_lambda = keras.Sequential(
        [keras.Input((16,)), keras.layers.Lambda(lambda t: t * 2), keras.layers.Dense(4)]
    )
    return {
        "functional": json.loads(functional.to_json()),
        "sequential": json.loads(sequential.to_json()),
        "lambda": json.loads(with_lambda.to_json()),
    }


@pytest.fixture(scope="module")
def configs() -> dict[str, dict[str, Any]]:
    return keras_configs()


SYNTH = {"samples": 64, "features": 784, "classes": 10}


@pytest.mark.parametrize(
    "body",
    [
        {"model": {"kind": "cnn"}, "data": SYNTH},
        {
            "model": {"kind": "cnn", "input_shape": [32, 32, 3]},
            "data": {"kind": "keras", "name": "cifar10"},
        },
        {
            "model": {"kind": "cnn", "input_shape": [28, 28, 1]},
            "data": {"kind": "keras", "name": "mnist"},
        },
        {
            "model": {
                "kind": "transformer",
                "sequence_length": 16,
                "features": 4,
                "num_classes": 3,
            },
            "data": {"samples": 64, "features": 64, "classes": 3},
        },
        {
            "model": {
                "kind": "transformer",
                "sequence_length": 28,
                "features": 28,
                "num_classes": 10,
            },
            "data": {"kind": "keras", "name": "fashion_mnist"},
        },
    ],
    ids=[
        "cnn-synthetic",
        "cnn-cifar10",
        "cnn-mnist",
        "transformer-synthetic",
        "transformer-fashion",
    ],
)
def test_presets_on_matching_data_are_accepted(api: Api, body: dict[str, Any]) -> None:
    r = api.post("/v1/jobs?dry_run=true", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "field", "rule"),
    [
        (
            {"model": {"kind": "cnn"}, "data": {"kind": "keras", "name": "cifar10"}},
            "model.input_shape",
            "shape_mismatch",
        ),
        (
            {"model": {"kind": "cnn", "input_shape": [28, 28]}, "data": SYNTH},
            "model.input_shape",
            "too_short",
        ),
        (
            {"model": {"kind": "cnn", "num_classes": 3}, "data": SYNTH},
            "model.num_classes",
            "shape_mismatch",
        ),
        (
            {"model": {"kind": "transformer"}, "data": SYNTH},
            "model.sequence_length",
            "shape_mismatch",
        ),
        (
            {"model": {"kind": "transformer", "embed_dim": 30, "num_heads": 4}, "data": SYNTH},
            "model",
            "heads",
        ),
        (
            {
                "model": {
                    "kind": "cnn",
                    "input_shape": [32, 32, 3],
                    "filters": [1024, 1024],
                    "kernel_size": 11,
                },
                "data": {"kind": "keras", "name": "cifar10"},
            },
            "model",
            "limit",
        ),
    ],
    ids=[
        "cnn-wrong-image",
        "cnn-2d-shape",
        "cnn-classes",
        "transformer-wrong-size",
        "heads",
        "cnn-too-big",
    ],
)
def test_presets_on_mismatching_data_are_422(
    api: Api, body: dict[str, Any], field: str, rule: str
) -> None:
    r = api.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    assert (field, rule) in [(f["field"], f["rule"]) for f in r.json()["fields"]]


@pytest.mark.keras
def test_keras_configs_from_to_json_are_accepted_as_object_or_text(
    api: Api, configs: dict[str, dict[str, Any]]
) -> None:
    data = {"samples": 64, "features": 16, "classes": 4}
    for name in ("functional", "sequential"):
        for config in (configs[name], json.dumps(configs[name])):
            r = api.post(
                "/v1/jobs?dry_run=true",
                json={"model": {"kind": "keras", "config": config}, "data": data},
            )
            assert r.status_code == 200, (name, r.text)


@pytest.mark.keras
def test_a_lambda_layer_is_refused(api: Api, configs: dict[str, dict[str, Any]]) -> None:
    r = api.post("/v1/jobs", json={"model": {"kind": "keras", "config": configs["lambda"]}})
    assert r.status_code == 422
    field = r.json()["fields"][0]
    assert field["field"] == "model.config" and field["rule"] == "lambda_layer"
    assert "bytecode" in field["message"]
    assert api.get("/v1/jobs").json()["items"] == []


@pytest.mark.keras
@pytest.mark.parametrize(
    ("mutate", "rule"),
    [
        (
            lambda c: c["config"]["layers"][1].update(
                registered_name="evil>Backdoor", class_name="Backdoor"
            ),
            "custom_object",
        ),
        (lambda c: c["config"]["layers"][1].update(class_name="MyLayer"), "unknown_layer"),
        (lambda c: c["config"]["layers"][1].update(module="evil.layers"), "custom_object"),
        (
            lambda c: c["config"]["layers"][1]["config"].update(
                activation={"class_name": "__lambda__", "config": {"code": "x"}}
            ),
            "function",
        ),
        (lambda c: c.update(class_name="Dense"), "model_config"),
        (lambda c: c["config"].update(layers=[]), "model_config"),
    ],
    ids=[
        "registered-custom",
        "unknown-class",
        "foreign-module",
        "serialized-function",
        "not-a-model",
        "no-layers",
    ],
)
def test_unsafe_or_malformed_configs_are_refused(
    api: Api, configs: dict[str, dict[str, Any]], mutate: Any, rule: str
) -> None:
    config = json.loads(json.dumps(configs["sequential"]))
    mutate(config)
    r = api.post("/v1/jobs", json={"model": {"kind": "keras", "config": config}})
    assert r.status_code == 422, r.text
    assert r.json()["fields"][0]["rule"] == rule


def test_config_text_that_is_not_json_is_422(api: Api) -> None:
    r = api.post("/v1/jobs", json={"model": {"kind": "keras", "config": "{not json"}})
    assert r.status_code == 422
    assert r.json()["fields"][0] == {
        "field": "model.config",
        "rule": "json",
        "message": r.json()["fields"][0]["message"],
    }
