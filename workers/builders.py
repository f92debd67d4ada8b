"""Building a job's Keras model and optimizer from its spec (training child only)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras

from workers.losses import build_schedule
from workers.protocol import JobError


@dataclass(frozen=True)
class _Ends:
    """What the data and the spec fix at a preset's two ends: the shape of one sample, the
    classes the labels hold (0 for targets), the head's activation and whether the output
    is float32."""

    sample_shape: tuple[int, ...]
    num_classes: int
    output_float32: bool
    head: str


def build_model(
    spec: dict[str, Any],
    sample_shape: tuple[int, ...],
    num_classes: int,
    max_parameters: int | None = None,
) -> keras.Model:
    """Build under the current global dtype policy (set by the caller)."""
    model = spec["model"]
    output_float32 = spec["precision"]["output_float32"]
    kind = model["kind"]
    head = head_activation(spec["training"].get("loss", {}).get("name", ""))
    if head != "softmax":
        num_classes = 0  # targets, not class labels: the model's output width is its own
    if kind in _PRESETS:
        built = _PRESETS[kind](model, _Ends(sample_shape, num_classes, output_float32, head))
    elif kind == "keras":
        built = _from_config(
            model["config"], sample_shape, spec["precision"]["policy"], output_float32
        )
    else:
        raise JobError(f"unknown model kind {kind!r}")
    params = built.count_params()
    if max_parameters is not None and params > max_parameters:
        raise JobError(
            f"the model has {params} parameters; the server's limit is {max_parameters} "
            "(HALFWAY_MAX_PARAMETERS)"
        )
    return built


def head_activation(loss_name: str) -> str:
    """The presets' output activation for the loss: softmax for the cross-entropies over
    classes, sigmoid for binary cross-entropy (multi-label), none for a regression."""
    if loss_name in ("sparse_categorical_crossentropy", "categorical_crossentropy", ""):
        return "softmax"
    return "sigmoid" if loss_name == "binary_crossentropy" else "linear"


def _check_classes(num_classes: int, model_classes: int) -> None:
    if num_classes > model_classes:
        raise JobError(
            f"the data has labels up to {num_classes - 1} but model.num_classes is {model_classes}"
        )


def _fit_input(
    sample_shape: tuple[int, ...], wanted: tuple[int, ...], field: str
) -> list[keras.layers.Layer]:
    """An Input for the data's samples, reshaped to what the model takes (same size)."""
    layers: list[keras.layers.Layer] = [keras.Input(shape=sample_shape, name="inputs")]
    if math.prod(sample_shape) != math.prod(wanted):
        raise JobError(
            f"model.{field} takes samples of shape {wanted} ({math.prod(wanted)} values) but "
            f"the data's samples have shape {sample_shape} ({math.prod(sample_shape)} values)"
        )
    if tuple(sample_shape) != tuple(wanted):
        layers.append(keras.layers.Reshape(wanted, name="to_model_shape"))
    return layers


def _cnn(model: dict[str, Any], ends: _Ends) -> keras.Model:
    _check_classes(ends.num_classes, model["num_classes"])
    layers = _fit_input(ends.sample_shape, tuple(model["input_shape"]), "input_shape")
    for i, filters in enumerate(model["filters"]):
        layers += [
            keras.layers.Conv2D(
                filters,
                model["kernel_size"],
                padding="same",
                activation=model["activation"],
                name=f"conv_{i}",
            ),
            keras.layers.MaxPooling2D(2, padding="same", name=f"pool_{i}"),
        ]
    layers += [
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(model["dense"], activation=model["activation"], name="dense"),
    ]
    if model.get("dropout"):
        layers.append(keras.layers.Dropout(model["dropout"], name="dropout"))
    layers += _classifier_head(model["num_classes"], ends)
    return keras.Sequential(layers, name="cnn")


def _transformer(model: dict[str, Any], ends: _Ends) -> keras.Model:
    _check_classes(ends.num_classes, model["num_classes"])
    seq, width = model["sequence_length"], model["embed_dim"]
    (inputs, *reshape) = _fit_input(ends.sample_shape, (seq, model["features"]), "sequence_length")
    x = inputs
    for layer in reshape:
        x = layer(x)
    x = keras.layers.Dense(width, name="embed")(x)
    x = PositionEmbedding(seq, width, name="positions")(x)
    for i in range(model["num_layers"]):
        attended = keras.layers.MultiHeadAttention(
            model["num_heads"],
            width // model["num_heads"],
            dropout=model["dropout"],
            name=f"attention_{i}",
        )(x, x)
        x = keras.layers.LayerNormalization(name=f"norm_a{i}")(x + attended)
        ff = keras.layers.Dense(model["ff_dim"], activation="gelu", name=f"ff_{i}")(x)
        ff = keras.layers.Dense(width, name=f"ff_out_{i}")(ff)
        if model.get("dropout"):
            ff = keras.layers.Dropout(model["dropout"], name=f"dropout_{i}")(ff)
        x = keras.layers.LayerNormalization(name=f"norm_f{i}")(x + ff)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    for layer in _classifier_head(model["num_classes"], ends):
        x = layer(x)
    return keras.Model(inputs, x, name="transformer")


@keras.saving.register_keras_serializable(package="halfway")
class PositionEmbedding(keras.layers.Layer):  # type: ignore[misc]
    """A learned embedding per position, added to the sequence. (Registered, so the saved
    .keras file loads wherever ``workers.builders`` is importable.)"""

    def __init__(self, length: int, width: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.length, self.width = length, width

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        return {**config, "length": self.length, "width": self.width}

    def build(self, input_shape: Any) -> None:
        self.positions = self.add_weight(
            shape=(self.length, self.width), initializer="glorot_uniform", name="positions"
        )

    def call(self, x: Any) -> Any:
        return x + keras.ops.cast(self.positions, x.dtype)


def _from_config(
    config: dict[str, Any], sample_shape: tuple[int, ...], policy: str, output_float32: bool
) -> keras.Model:
    """A user's model.to_json(), deserialized in Keras' safe mode (no Lambda bytecode, no
    custom objects), with every layer set to the job's precision policy."""
    config = copy.deepcopy(config)
    _set_policies(config, policy, output_float32)
    try:
        model = keras.saving.deserialize_keras_object(config, safe_mode=True)
    except Exception as exc:  # Keras refuses it: a clear job error, not a crash to retry
        raise JobError(f"Keras could not build model.config: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, keras.Model):
        raise JobError("model.config did not describe a model")
    wanted = tuple(model.input_shape[1:]) if not isinstance(model.input_shape, list) else None
    if wanted is None or any(d is None for d in wanted):
        raise JobError("model.config must have one input with a fully known shape")
    if tuple(sample_shape) == wanted:
        return model
    layers = _fit_input(sample_shape, wanted, "config")
    x = layers[0]
    for layer in layers[1:]:
        x = layer(x)
    return keras.Model(layers[0], model(x), name=f"{model.name}_reshaped")


def _set_policies(config: dict[str, Any], policy: str, output_float32: bool) -> None:
    """Every layer under the job's policy (a config saved under float32 names float32 on each
    layer, which would silently switch mixed precision off), and the output layer in float32
    when the spec asks for it, as the TensorFlow guide advises."""
    layers = config["config"]["layers"]
    for layer in layers:
        if layer.get("class_name") == "InputLayer":
            continue
        layer.setdefault("config", {})["dtype"] = policy
        if layer.get("class_name") in ("Sequential", "Functional", "Model"):
            _set_policies(layer, policy, output_float32)
    if not output_float32:
        return
    last_name = None
    outputs = config["config"].get("output_layers")
    if outputs:  # Functional: [[name, node, tensor], ...] (or one triple)
        first = outputs[0] if isinstance(outputs[0], list) else outputs
        last_name = first[0]
    for layer in reversed(layers):
        if last_name is None or layer.get("config", {}).get("name") == last_name:
            if layer.get("class_name") != "InputLayer":
                layer["config"]["dtype"] = "float32"
            break


def _classifier_head(num_classes: int, ends: _Ends) -> list[keras.layers.Layer]:
    activation = ends.head
    if ends.output_float32:
        # The TensorFlow guide's advice: logits in the compute dtype, softmax in float32 so
        # its exp() cannot overflow float16.
        return [
            keras.layers.Dense(num_classes, name="logits"),
            keras.layers.Activation(activation, dtype="float32", name="predictions"),
        ]
    return [keras.layers.Dense(num_classes, activation=activation, name="predictions")]


def _mlp(model: dict[str, Any], ends: _Ends) -> keras.Model:
    features = math.prod(ends.sample_shape)
    if features != model["input_size"]:
        raise JobError(
            f"model.input_size is {model['input_size']} but the data has {features} features "
            f"per sample (shape {ends.sample_shape})"
        )
    _check_classes(ends.num_classes, model["num_classes"])
    layers: list[keras.layers.Layer] = [keras.Input(shape=ends.sample_shape, name="inputs")]
    if len(ends.sample_shape) > 1:
        layers.append(keras.layers.Flatten(name="flatten"))
    for i, width in enumerate(model["hidden"]):
        layers.append(keras.layers.Dense(width, activation=model["activation"], name=f"dense_{i}"))
        if model.get("dropout"):
            layers.append(keras.layers.Dropout(model["dropout"], name=f"dropout_{i}"))
    layers += _classifier_head(model["num_classes"], ends)
    return keras.Sequential(layers, name="mlp")


_PRESETS: dict[str, Callable[[dict[str, Any], _Ends], keras.Model]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "transformer": _transformer,
}


def build_optimizer(opt: dict[str, Any]) -> keras.optimizers.Optimizer:
    common: dict[str, Any] = {"learning_rate": build_schedule(opt)}
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
