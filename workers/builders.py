"""Building a job's Keras model and optimizer from its spec (training child only)."""

from __future__ import annotations

from typing import Any

import keras

from workers.protocol import JobError


def build_model(
    spec: dict[str, Any], sample_shape: tuple[int, ...], num_classes: int
) -> keras.Model:
    """Build under the current global dtype policy (set by the caller)."""
    model = spec["model"]
    output_float32 = spec["precision"]["output_float32"]
    kind = model["kind"]
    if kind == "mlp":
        return _mlp(model, sample_shape, num_classes, output_float32)
    raise JobError(f"unknown model kind {kind!r}")


def _classifier_head(num_classes: int, output_float32: bool) -> list[keras.layers.Layer]:
    if output_float32:
        # The TensorFlow guide's advice: logits in the compute dtype, softmax in float32 so
        # its exp() cannot overflow float16.
        return [
            keras.layers.Dense(num_classes, name="logits"),
            keras.layers.Activation("softmax", dtype="float32", name="predictions"),
        ]
    return [keras.layers.Dense(num_classes, activation="softmax", name="predictions")]


def _mlp(
    model: dict[str, Any], sample_shape: tuple[int, ...], num_classes: int, output_float32: bool
) -> keras.Model:
    features = 1
    for d in sample_shape:
        features *= d
    if features != model["input_size"]:
        raise JobError(
            f"model.input_size is {model['input_size']} but the data has {features} features "
            f"per sample (shape {sample_shape})"
        )
    if num_classes > model["num_classes"]:
        raise JobError(
            f"the data has labels up to {num_classes - 1} but model.num_classes is "
            f"{model['num_classes']}"
        )
    layers: list[keras.layers.Layer] = [keras.Input(shape=sample_shape, name="inputs")]
    if len(sample_shape) > 1:
        layers.append(keras.layers.Flatten(name="flatten"))
    for i, width in enumerate(model["hidden"]):
        layers.append(keras.layers.Dense(width, activation=model["activation"], name=f"dense_{i}"))
        if model.get("dropout"):
            layers.append(keras.layers.Dropout(model["dropout"], name=f"dropout_{i}"))
    layers += _classifier_head(model["num_classes"], output_float32)
    return keras.Sequential(layers, name="mlp")


def build_optimizer(opt: dict[str, Any]) -> keras.optimizers.Optimizer:
    common: dict[str, Any] = {"learning_rate": opt["learning_rate"]}
    for key in ("epsilon", "weight_decay", "clipnorm"):
        if opt.get(key) is not None:
            common[key] = opt[key]
    name = opt["name"]
    if name in ("adam", "adamw"):
        for key in ("beta_1", "beta_2"):
            if opt.get(key) is not None:
                common[key] = opt[key]
        cls = keras.optimizers.Adam if name == "adam" else keras.optimizers.AdamW
        return cls(**common)
    if name == "sgd":
        return keras.optimizers.SGD(
            momentum=opt.get("momentum") or 0.0, nesterov=bool(opt.get("nesterov")), **common
        )
    if name == "rmsprop":
        return keras.optimizers.RMSprop(momentum=opt.get("momentum") or 0.0, **common)
    raise JobError(f"unknown optimizer {name!r}")


def precision_report(model: keras.Model) -> list[dict[str, Any]]:
    """Each layer's variable, compute and output dtype: the seeds' 'Dense under
    mixed_float16 outputs float16', for every layer of this job."""
    report = []
    for layer in model.layers:
        policy = layer.dtype_policy
        try:
            output_dtype = str(layer.output.dtype)
        except (AttributeError, ValueError):
            output_dtype = None
        report.append(
            {
                "layer": layer.name,
                "class": type(layer).__name__,
                "policy": policy.name,
                "variable_dtype": policy.variable_dtype,
                "compute_dtype": policy.compute_dtype,
                "output_dtype": output_dtype,
                "parameters": int(layer.count_params()) if layer.built else 0,
            }
        )
    return report
