"""Checking a Keras model config (``model.to_json()``) before anyone deserializes it.

The API cannot import Keras, and must not have to: a model config is plain JSON, and what makes
one dangerous is visible in it. A ``Lambda`` layer carries Python bytecode, a custom object
names code the worker would have to import, and a serialized function is code too. So the
API walks the config and admits only the built-in layer classes below (the training child then
deserializes it in Keras' safe mode as well).
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

MODEL_CLASSES = {"Sequential", "Functional", "Model"}

# Built-in Keras 3 layers that hold no user code.
LAYER_CLASSES = frozenset(
    [
        "InputLayer",
        "Dense",
        "EinsumDense",
        "Activation",
        "Embedding",
        "Masking",
        "Identity",
        "Conv1D",
        "Conv2D",
        "Conv3D",
        "SeparableConv1D",
        "SeparableConv2D",
        "DepthwiseConv1D",
        "DepthwiseConv2D",
        "Conv1DTranspose",
        "Conv2DTranspose",
        "Conv3DTranspose",
        "MaxPooling1D",
        "MaxPooling2D",
        "MaxPooling3D",
        "AveragePooling1D",
        "AveragePooling2D",
        "AveragePooling3D",
        "GlobalMaxPooling1D",
        "GlobalMaxPooling2D",
        "GlobalMaxPooling3D",
        "GlobalAveragePooling1D",
        "GlobalAveragePooling2D",
        "GlobalAveragePooling3D",
        "BatchNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "UnitNormalization",
        "Dropout",
        "SpatialDropout1D",
        "SpatialDropout2D",
        "SpatialDropout3D",
        "GaussianNoise",
        "GaussianDropout",
        "AlphaDropout",
        "ActivityRegularization",
        "MultiHeadAttention",
        "Attention",
        "AdditiveAttention",
        "GroupedQueryAttention",
        "Flatten",
        "Reshape",
        "Permute",
        "RepeatVector",
        "Cropping1D",
        "Cropping2D",
        "Cropping3D",
        "ZeroPadding1D",
        "ZeroPadding2D",
        "ZeroPadding3D",
        "UpSampling1D",
        "UpSampling2D",
        "UpSampling3D",
        "Add",
        "Subtract",
        "Multiply",
        "Average",
        "Maximum",
        "Minimum",
        "Concatenate",
        "Dot",
        "LSTM",
        "GRU",
        "SimpleRNN",
        "Bidirectional",
        "TimeDistributed",
        "LSTMCell",
        "GRUCell",
        "SimpleRNNCell",
        "RNN",
        "ReLU",
        "LeakyReLU",
        "PReLU",
        "ELU",
        "Softmax",
        "Rescaling",
    ]
)
FUNCTION_CLASSES = {"__lambda__", "__function__", "function"}
KERAS_TENSOR = "__keras_tensor__"
MAX_DEPTH = 64


def _refuse(rule: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(rule, message)


def check_model_config(config: dict[str, Any]) -> None:
    """Raise a PydanticCustomError (a 422 on ``model.config``) unless ``config`` is a
    Sequential or Functional model made only of built-in layers."""
    if config.get("class_name") not in MODEL_CLASSES:
        raise _refuse(
            "model_config",
            "must be what model.to_json() returns for a Sequential or Functional model "
            f"(class_name Sequential or Functional), not {config.get('class_name')!r}",
        )
    inner = config.get("config")
    if not isinstance(inner, dict) or not isinstance(inner.get("layers"), list):
        raise _refuse("model_config", "has no config.layers list")
    if not inner["layers"]:
        raise _refuse("model_config", "has no layers")
    _walk(config, "model", 0)


def _walk(node: Any, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _refuse("model_config", f"nests deeper than {MAX_DEPTH} levels")
    if isinstance(node, list):
        for i, item in enumerate(node):
            _walk(item, f"{where}[{i}]", depth + 1)
        return
    if not isinstance(node, dict):
        return
    if "class_name" in node:
        _check_object(node, where)
    for key, value in node.items():
        _walk(value, f"{where}.{key}", depth + 1)


def _check_object(node: dict[str, Any], where: str) -> None:
    name = node.get("class_name")
    module = node.get("module")
    registered = node.get("registered_name")
    if name == "Lambda":
        raise _refuse(
            "lambda_layer",
            f"{where} is a Lambda layer: its Python bytecode would run on the worker, so "
            "Halfway refuses it. Express it with built-in layers.",
        )
    if name in FUNCTION_CLASSES:
        raise _refuse("function", f"{where} is a serialized Python function; not accepted")
    if not isinstance(name, str):
        raise _refuse("model_config", f"{where} has a class_name that is not a string")
    if isinstance(registered, str) and ">" in registered:
        raise _refuse(
            "custom_object",
            f"{where} is the custom object {registered!r}; only built-in Keras classes are "
            "accepted (no custom objects)",
        )
    if module is not None and not (isinstance(module, str) and module.split(".")[0] == "keras"):
        raise _refuse(
            "custom_object",
            f"{where} comes from module {module!r}; only built-in Keras classes are accepted",
        )
    if module is None and name == KERAS_TENSOR:
        return  # a Functional model's reference to another layer's output
    is_layer = module in (None, "keras.layers") or (
        isinstance(module, str) and module.startswith("keras.src.layers")
    )
    if is_layer and name not in LAYER_CLASSES and name not in MODEL_CLASSES:
        raise _refuse(
            "unknown_layer",
            f"{where} is a {name!r}, which is not one of the built-in layers Halfway accepts",
        )
