"""What users write: the job spec and the sweep spec (pydantic, ``extra="forbid"``, JSON's
types strictly), and the normalized submission. The API's answers are in service/responses.py.

The spec speaks the language of TensorFlow's mixed-precision guide (policies, loss scaling)
and accepts the forms older guides teach, mapping each to what Keras 3 does; every mapping
is reported back in the response's ``notes``.
"""

from __future__ import annotations

import itertools
import json
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.modelconfig import check_model_config
from service.policies import (
    AUTO,
    AUTO_CANDIDATES,
    POLICIES,
    PolicyChoice,
    PolicyName,
    UnexpressiblePolicy,
    policy_for_pair,
)

LEGACY_AMP_ENV = "TF_ENABLE_AUTO_MIXED_PRECISION"
LEGACY_AMP_EXPLANATION = (
    "TF_ENABLE_AUTO_MIXED_PRECISION does nothing in TensorFlow 2.x. For Keras mixed precision "
    "set precision.policy (e.g. 'mixed_float16', which is what Halfway runs by default, with "
    "dynamic loss scaling). For TensorFlow's graph rewrite, the TF 2 equivalent of that "
    "variable (grappler's 'auto_mixed_precision'), set precision.graph_rewrite: true with "
    "precision.policy 'float32'."
)

MAX_INT32 = 2**31 - 1

# Names are labels for people: no control characters (PostgreSQL text cannot even hold NUL).
NAME_PATTERN = r"^[^\x00-\x1f\x7f]*$"


def _int_kind(annotation: Any) -> Literal["int", "list"] | None:
    """Whether a field takes an integer, or a list of integers."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _int_kind(get_args(annotation)[0])
    if annotation is int:
        return "int"
    if origin is list:
        return "list" if _int_kind(get_args(annotation)[0]) == "int" else None
    if origin in (Union, types.UnionType):
        kinds = {_int_kind(a) for a in get_args(annotation)}
        return "int" if "int" in kinds else "list" if "list" in kinds else None
    return None


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


class StrictModel(BaseModel):
    """Input models: unknown fields and NaN/Infinity are refused, and types are JSON's own.
    Pydantic's lax mode reads ``false`` as 0, ``"5"`` as 5 and ``1`` as true; in a JSON body
    each of those is a client's mistake, so it is a 422 naming the field (strict mode; a
    nested object may still be given as a JSON object). JSON has one number type, and JSON
    Schema calls 29.0 an integer, so an integer field takes 29.0 (as 29), never 29.5."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fixed = dict(data)
        for name, field in cls.model_fields.items():
            if name not in data:
                continue
            kind = _int_kind(field.annotation)
            if kind == "int":
                fixed[name] = _integral(data[name])
            elif kind == "list" and isinstance(data[name], list):
                fixed[name] = [_integral(v) for v in data[name]]
        return fixed


# --------------------------------------------------------------------------------------------
# Precision


class DtypePair(StrictModel):
    """An explicit dtype pair, as the old ``Policy('custom', {...})`` examples show."""

    name: Literal["custom"] | None = Field(
        default=None, description="Accepted for the old Policy('custom', {...}) form; ignored."
    )
    variable_dtype: Literal["float16", "bfloat16", "float32", "float64"]
    compute_dtype: Literal["float16", "bfloat16", "float32", "float64"]


def _policy_name(value: Any) -> Any:
    """Turn a dtype pair into the Keras name it means; a pair Keras cannot express is an error."""
    if not isinstance(value, dict):
        return value
    try:
        pair = DtypePair.model_validate(value)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise PydanticCustomError(
            "dtype_pair",
            "an explicit policy needs variable_dtype and compute_dtype ({problems})",
            {"problems": problems},
        ) from None
    try:
        return policy_for_pair(pair.variable_dtype, pair.compute_dtype)
    except UnexpressiblePolicy as exc:
        raise PydanticCustomError("unexpressible_policy", str(exc)) from None


def _pair_schema(variable: str, compute: str) -> dict[str, Any]:
    pair = DtypePair.model_json_schema()
    properties = {
        **pair["properties"],
        "variable_dtype": {"const": variable},
        "compute_dtype": {"const": compute},
    }
    return {**pair, "properties": properties}


# Only the pairs a Keras policy has: the others are refused (unexpressible_policy).
PolicyField = Annotated[
    PolicyChoice,
    BeforeValidator(_policy_name),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "enum": [*POLICIES, AUTO]},
                *(_pair_schema(p.variable_dtype, p.compute_dtype) for p in POLICIES.values()),
            ]
        }
    ),
]


class ProbeSpec(StrictModel):
    """How policy 'auto' chooses. Before the job trains, each candidate (float32,
    mixed_bfloat16, mixed_float16) runs warmup + steps steps from the same initial weights on
    the same batches; the job then trains with the fastest candidate whose loss tracks
    float32's within loss_tolerance and whose lost_share stays at most max_lost_share (a mixed
    policy must also beat float32 by min_speedup). The probes are not in the step history."""

    steps: int = Field(
        default=20, ge=2, le=1000, description="Timed steps per candidate, after its warm-up."
    )
    warmup: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="Untimed steps per candidate first, so tracing and compilation do not "
        "count as its step time (its lost_share is measured on these).",
    )
    loss_tolerance: float = Field(
        default=0.05,
        gt=0,
        le=10,
        description="How far a candidate's mean probe loss may stray from float32's, as a "
        "fraction of float32's (0.05: within 5%).",
    )
    max_lost_share: float = Field(
        default=0.01,
        ge=0,
        le=1,
        description="The largest lost_share a candidate may show (its mean over the probe): "
        "the share of gradient elements nonzero in float32 but flushed to zero in its own "
        "precision.",
    )
    min_speedup: float = Field(
        default=1.05,
        ge=1,
        le=100,
        description="A mixed policy is chosen only if it runs at least this many times as fast "
        "as float32 (median step time); otherwise float32 is.",
    )


class PrecisionSpec(StrictModel):
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"graph_rewrite": {"const": True}}, "required": ["graph_rewrite"]},
            "then": {
                "required": ["policy"],
                "properties": {
                    "policy": {
                        "anyOf": [
                            {"const": "float32"},
                            {
                                "type": "object",
                                "properties": {
                                    "variable_dtype": {"const": "float32"},
                                    "compute_dtype": {"const": "float32"},
                                },
                            },
                        ]
                    }
                },
            },
        }
    )

    policy: PolicyField = Field(
        default="mixed_float16",
        description="A Keras dtype policy name, or {variable_dtype, compute_dtype} mapped to "
        "the name it means, or 'auto': probe "
        + ", ".join(AUTO_CANDIDATES)
        + " on this model before training and train with the one precision.probe picks.",
    )
    output_float32: bool = Field(
        default=True,
        description="Run the output activation in float32 (the TensorFlow guide's advice), so a "
        "float16 softmax cannot overflow.",
    )
    graph_rewrite: bool = Field(
        default=False,
        description="TensorFlow's grappler auto_mixed_precision rewrite (the TF 2 form of "
        "TF_ENABLE_AUTO_MIXED_PRECISION): auto_mixed_precision on GPU, "
        "auto_mixed_precision_onednn_bfloat16 on CPU. Needs policy 'float32'.",
    )
    probe: ProbeSpec = Field(
        default_factory=ProbeSpec,
        description="How policy 'auto' probes and chooses; other policies ignore it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_forms(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(str(k).upper() == LEGACY_AMP_ENV for k in data):
            raise PydanticCustomError("legacy_env_var", LEGACY_AMP_EXPLANATION)
        return data

    @model_validator(mode="after")
    def _rewrite_needs_float32(self) -> PrecisionSpec:
        if self.graph_rewrite and self.policy == AUTO:
            raise PydanticCustomError(
                "graph_rewrite_conflict",
                "precision.graph_rewrite cannot be combined with policy 'auto': 'auto' may "
                "pick a mixed policy, and the grappler rewrite needs a float32 graph (on a "
                "mixed one it would cast twice). Use policy 'float32' with graph_rewrite, or "
                "'auto' without it.",
            )
        if self.graph_rewrite and self.policy != "float32":
            raise PydanticCustomError(
                "graph_rewrite_conflict",
                "precision.graph_rewrite cannot be combined with the Keras policy "
                f"'{self.policy}': the grappler rewrite casts a float32 graph to 16-bit on its "
                "own, and on top of a Keras mixed policy it would cast twice and keep no "
                "float32 master weights it knows about. Use policy 'float32' with "
                "graph_rewrite, or a mixed policy without it.",
            )
        return self


# --------------------------------------------------------------------------------------------
# Loss scaling


class LossScaleSpec(StrictModel):
    # The legacy dynamic flag names a mode; JSON Schema can say which (see _consistent).
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"dynamic": {"const": flag}}, "required": ["dynamic"]},
                    "then": {"properties": {"mode": {"enum": ["auto", mode]}}},
                }
                for flag, mode in ((True, "dynamic"), (False, "fixed"))
            ]
        }
    )

    mode: Literal["auto", "dynamic", "fixed", "none"] = Field(
        default="auto",
        description="auto: dynamic for float16 compute, none otherwise. fixed: a constant "
        "scale that still skips non-finite updates (the old dynamic=False).",
    )
    initial_scale: float = Field(default=2.0**15, ge=2.0**-24, le=2.0**64)
    growth_steps: int = Field(
        default=2000, ge=1, le=10**9, description="Finite steps in a row before growing."
    )
    growth_factor: float = Field(default=2.0, gt=1, le=2.0**16)
    backoff_factor: float = Field(default=0.5, gt=0, lt=1)
    # The scale is a float32: keep it a normal float32 number (>= 2**-24 is plenty).
    min_scale: float = Field(default=1.0, ge=2.0**-24, le=2.0**64)
    max_scale: float = Field(default=2.0**24, ge=2.0**-24, le=2.0**64)
    hysteresis: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="Overflows tolerated before backing off; refilled when the scale grows.",
    )
    dynamic: bool | None = Field(
        default=None,
        description="The old LossScaleOptimizer(dynamic=...) argument: true means mode "
        "'dynamic', false means mode 'fixed'.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LossScaleSpec:
        if self.dynamic is not None:
            wanted = "dynamic" if self.dynamic else "fixed"
            if self.mode not in ("auto", wanted):
                raise PydanticCustomError(
                    "conflicting_mode",
                    f"dynamic={str(self.dynamic).lower()} means mode '{wanted}', but mode is "
                    f"'{self.mode}'",
                )
        if self.min_scale > self.max_scale:
            raise PydanticCustomError("scale_bounds", "min_scale must not exceed max_scale")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise PydanticCustomError(
                "scale_bounds",
                f"initial_scale {self.initial_scale:g} must lie within [min_scale, max_scale] = "
                f"[{self.min_scale:g}, {self.max_scale:g}]",
            )
        return self


# --------------------------------------------------------------------------------------------
# Model

Activation = Literal["relu", "gelu", "tanh", "sigmoid", "swish", "elu", "selu", "linear"]


class MLPModel(StrictModel):
    kind: Literal["mlp"] = "mlp"
    input_size: int = Field(default=784, ge=1, le=10**7)
    hidden: list[Annotated[int, Field(ge=1, le=65_536)]] = Field(
        default_factory=lambda: [128], max_length=64
    )
    activation: Activation = "relu"
    num_classes: int = Field(
        default=10, ge=1, le=100_000, description="Outputs; 1 for a regression loss"
    )
    dropout: float = Field(default=0.0, ge=0, lt=1)

    def parameter_count(self) -> int:
        sizes = [self.input_size, *self.hidden, self.num_classes]
        return sum((a + 1) * b for a, b in itertools.pairwise(sizes))


class CNNModel(StrictModel):
    """A small convolutional classifier for images: per block a 'same' convolution and a
    2x2 max-pool, then a dense layer and the classifier."""

    kind: Literal["cnn"]
    input_shape: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=lambda: [28, 28, 1],
        min_length=3,
        max_length=3,
        description="Height, width, channels of one sample.",
    )
    filters: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=lambda: [32, 64], min_length=1, max_length=8
    )
    kernel_size: int = Field(default=3, ge=1, le=11)
    dense: int = Field(default=128, ge=1, le=65_536)
    activation: Activation = "relu"
    num_classes: int = Field(
        default=10, ge=1, le=100_000, description="Outputs; 1 for a regression loss"
    )
    dropout: float = Field(default=0.0, ge=0, lt=1)

    def parameter_count(self) -> int:
        height, width, channels = self.input_shape
        total = 0
        for f in self.filters:
            total += (self.kernel_size * self.kernel_size * channels + 1) * f
            channels = f
            height, width = max(1, height // 2), max(1, width // 2)
        flat = height * width * channels
        return total + (flat + 1) * self.dense + (self.dense + 1) * self.num_classes


class TransformerModel(StrictModel):
    """A small Transformer encoder classifier for sequences of feature vectors: a projection
    to ``embed_dim``, learned positions, ``num_layers`` encoder blocks (multi-head attention and
    a feed-forward layer, each with a residual and layer normalization), average pooling and
    the classifier."""

    kind: Literal["transformer"]
    sequence_length: int = Field(default=32, ge=1, le=4096)
    features: int = Field(default=8, ge=1, le=4096, description="Features per position.")
    embed_dim: int = Field(default=64, ge=4, le=2048)
    num_heads: int = Field(default=4, ge=1, le=64)
    ff_dim: int = Field(default=128, ge=1, le=16_384)
    num_layers: int = Field(default=2, ge=1, le=24)
    num_classes: int = Field(
        default=2, ge=1, le=100_000, description="Outputs; 1 for a regression loss"
    )
    dropout: float = Field(default=0.1, ge=0, lt=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerModel:
        if self.embed_dim % self.num_heads:
            raise PydanticCustomError(
                "heads", "embed_dim must be a multiple of num_heads (each head gets a slice)"
            )
        return self

    def parameter_count(self) -> int:
        d = self.embed_dim
        per_layer = 4 * (d * d + d) + 2 * 2 * d + (d + 1) * self.ff_dim + (self.ff_dim + 1) * d
        return (
            (self.features + 1) * d
            + self.sequence_length * d
            + self.num_layers * per_layer
            + (d + 1) * self.num_classes
        )


class KerasModel(StrictModel):
    """Your own architecture: what ``model.to_json()`` produces (Sequential or Functional),
    as a JSON object or as that JSON text. Built in the training child with Keras' safe mode:
    no Lambda layers, no custom objects; only the built-in layer classes that
    service/modelconfig.py lists."""

    kind: Literal["keras"]
    config: dict[str, Any] | str = Field(description="model.to_json(), parsed or as text.")

    @field_validator("config")
    @classmethod
    def _parse(cls, value: dict[str, Any] | str) -> dict[str, Any]:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise PydanticCustomError(
                    "json", "is not valid JSON: {error}", {"error": str(exc)}
                ) from None
            if not isinstance(value, dict):
                raise PydanticCustomError("json", "must be a JSON object (model.to_json())")
        check_model_config(value)
        return value


def _kind_of(default: str, *kinds: str) -> Any:
    """Discriminate on ``kind``, which may be left out for the default kind."""

    def discriminate(value: Any) -> str:
        if isinstance(value, dict):
            return str(value.get("kind", default))
        return str(getattr(value, "kind", default))

    return Discriminator(
        discriminate,
        custom_error_type="unknown_kind",
        custom_error_message=f"kind must be one of: {', '.join(kinds)}",
    )


ModelSpec = Annotated[
    Annotated[MLPModel, Tag("mlp")]
    | Annotated[CNNModel, Tag("cnn")]
    | Annotated[TransformerModel, Tag("transformer")]
    | Annotated[KerasModel, Tag("keras")],
    _kind_of("mlp", "mlp", "cnn", "transformer", "keras"),
]


# --------------------------------------------------------------------------------------------
# Data


class SyntheticData(StrictModel):
    """Gaussian clusters around one random centre per class: learnable, so accuracy rises, but
    not trivially (the classes overlap at the default separation)."""

    kind: Literal["synthetic"] = "synthetic"
    samples: int = Field(default=10_000, ge=2, le=10**7)
    features: int = Field(default=784, ge=1, le=10**6)
    classes: int = Field(default=10, ge=2, le=100_000)
    separation: float = Field(
        default=3.0,
        gt=0,
        le=1000,
        description="Typical distance between class centres, in units of the per-feature "
        "noise; lower is harder.",
    )
    seed: int = Field(default=0, ge=0, le=MAX_INT32)


class NpzData(StrictModel):
    kind: Literal["npz"]
    path: str = Field(
        min_length=1,
        max_length=1024,
        description="Relative to the data directory; must stay inside it. Holds x_train and "
        "y_train, optionally x_val and y_val.",
    )
    max_samples: int | None = Field(default=None, ge=1, le=10**9)


class KerasData(StrictModel):
    kind: Literal["keras"]
    name: Literal["mnist", "fashion_mnist", "cifar10"]
    max_samples: int | None = Field(default=None, ge=1, le=10**9)


class ImageDirectoryData(StrictModel):
    """A folder of class sub-folders of images under the data directory, read with
    keras.utils.image_dataset_from_directory (labels from the sub-folder names, in order)."""

    kind: Literal["image_directory"]
    path: str = Field(
        min_length=1, max_length=1024, description="A folder inside the data directory."
    )
    image_size: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=lambda: [64, 64], min_length=2, max_length=2, description="[H, W]"
    )
    color_mode: Literal["grayscale", "rgb", "rgba"] = "rgb"
    validation_split: float = Field(default=0.0, ge=0, le=0.5)
    max_samples: int | None = Field(default=None, ge=1, le=10**9)

    @property
    def channels(self) -> int:
        return {"grayscale": 1, "rgb": 3, "rgba": 4}[self.color_mode]


KERAS_DATASET_SHAPES: dict[str, tuple[tuple[int, ...], int]] = {
    "mnist": ((28, 28), 10),
    "fashion_mnist": ((28, 28), 10),
    "cifar10": ((32, 32, 3), 10),
}

DataSpec = Annotated[
    Annotated[SyntheticData, Tag("synthetic")]
    | Annotated[NpzData, Tag("npz")]
    | Annotated[KerasData, Tag("keras")]
    | Annotated[ImageDirectoryData, Tag("image_directory")],
    _kind_of("synthetic", "synthetic", "npz", "keras", "image_directory"),
]


# --------------------------------------------------------------------------------------------
# Your own code

ENTRYPOINT = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
MAX_CODE_ARGS_BYTES = 64 * 1024


class CodeSpec(StrictModel):
    """Train your own code: ``entrypoint`` names a function in an uploaded bundle
    (POST /v1/code); the training child calls it with ``args`` and trains what it returns."""

    bundle: str = Field(
        pattern=r"^sha256:[0-9a-f]{64}$", description="The digest POST /v1/code answered."
    )
    entrypoint: str = Field(
        pattern=ENTRYPOINT, max_length=300, description="package.module:function"
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Any JSON object (up to 64 KB), passed to it."
    )

    @field_validator("args")
    @classmethod
    def _small_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            size = len(json.dumps(value, allow_nan=False).encode())
        except ValueError:
            raise PydanticCustomError("json", "must be plain JSON (no NaN or Infinity)") from None
        if size > MAX_CODE_ARGS_BYTES:
            raise PydanticCustomError(
                "too_large",
                "is {size} bytes of JSON; at most {limit}",
                {"size": size, "limit": MAX_CODE_ARGS_BYTES},
            )
        return value


# --------------------------------------------------------------------------------------------
# Optimizer and training


def _only_when(names: list[str], absent: list[str]) -> dict[str, Any]:
    """JSON Schema for "with one of these names, these arguments are null or left out"."""
    return {
        "if": {"properties": {"name": {"enum": names}}},
        "then": {"properties": {field: {"type": "null"} for field in absent}},
    }


class ScheduleSpec(StrictModel):
    """A learning-rate schedule from the optimizer's learning_rate, with an optional linear
    warm-up from 0 over ``warmup_steps`` first (the schedule then starts after it)."""

    kind: Literal["constant", "cosine_decay", "exponential_decay", "piecewise_constant"] = (
        "constant"
    )
    warmup_steps: int = Field(default=0, ge=0, le=10**9)
    decay_steps: int | None = Field(
        default=None, ge=1, le=10**9, description="cosine_decay and exponential_decay"
    )
    alpha: float | None = Field(
        default=None, ge=0, le=1, description="cosine_decay: the final fraction of the rate"
    )
    decay_rate: float | None = Field(default=None, gt=0, le=1, description="exponential_decay")
    staircase: bool | None = Field(default=None, description="exponential_decay")
    boundaries: list[Annotated[int, Field(ge=0, le=10**9)]] | None = Field(
        default=None, max_length=1000, description="piecewise_constant: steps, ascending"
    )
    values: list[Annotated[float, Field(gt=0, le=10)]] | None = Field(
        default=None,
        max_length=1001,
        description="piecewise_constant: one more rate than boundaries",
    )

    @model_validator(mode="after")
    def _arguments_fit(self) -> ScheduleSpec:
        allowed = {
            "constant": set(),
            "cosine_decay": {"decay_steps", "alpha"},
            "exponential_decay": {"decay_steps", "decay_rate", "staircase"},
            "piecewise_constant": {"boundaries", "values"},
        }[self.kind]
        for field in ("decay_steps", "alpha", "decay_rate", "staircase", "boundaries", "values"):
            if getattr(self, field) is not None and field not in allowed:
                raise PydanticCustomError(
                    "argument_not_for_schedule", f"{field} is not an argument of {self.kind}"
                )
        needed = {
            "cosine_decay": ["decay_steps"],
            "exponential_decay": ["decay_steps", "decay_rate"],
            "piecewise_constant": ["boundaries", "values"],
        }.get(self.kind, [])
        for field in needed:
            if getattr(self, field) is None:
                raise PydanticCustomError("missing", f"{self.kind} needs {field}")
        if self.kind == "piecewise_constant":
            assert self.boundaries is not None and self.values is not None
            if sorted(set(self.boundaries)) != self.boundaries:
                raise PydanticCustomError(
                    "boundaries", "boundaries must be strictly ascending steps"
                )
            if len(self.values) != len(self.boundaries) + 1:
                raise PydanticCustomError(
                    "values", "piecewise_constant needs one more value than boundaries"
                )
        return self


class OptimizerSpec(StrictModel):
    # The arguments each optimizer takes, as the validator below checks them (an absent name
    # is adam, which the first rule covers: an absent property satisfies "properties").
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                _only_when(["adam", "adamw"], ["momentum", "nesterov"]),
                _only_when(["sgd"], ["beta_1", "beta_2"]),
                _only_when(["rmsprop"], ["nesterov", "beta_1", "beta_2"]),
            ]
        }
    )

    name: Literal["adam", "adamw", "sgd", "rmsprop"] = "adam"
    learning_rate: float = Field(default=0.001, gt=0, le=10)
    momentum: float | None = Field(default=None, ge=0, lt=1, description="sgd and rmsprop")
    nesterov: bool | None = Field(default=None, description="sgd")
    beta_1: float | None = Field(default=None, gt=0, lt=1, description="adam and adamw")
    beta_2: float | None = Field(default=None, gt=0, lt=1, description="adam and adamw")
    epsilon: float | None = Field(default=None, gt=0, le=1)
    weight_decay: float | None = Field(default=None, ge=0, le=1)
    clipnorm: float | None = Field(default=None, gt=0, le=1e6)
    schedule: ScheduleSpec = Field(
        default_factory=lambda: ScheduleSpec(kind="constant"),
        description="How learning_rate changes with the optimizer's (applied) steps.",
    )

    @model_validator(mode="after")
    def _arguments_fit(self) -> OptimizerSpec:
        allowed = {
            "adam": {"beta_1", "beta_2"},
            "adamw": {"beta_1", "beta_2"},
            "sgd": {"momentum", "nesterov"},
            "rmsprop": {"momentum"},
        }[self.name]
        for field in ("momentum", "nesterov", "beta_1", "beta_2"):
            if getattr(self, field) is not None and field not in allowed:
                raise PydanticCustomError(
                    "argument_not_for_optimizer",
                    f"{field} is not an argument of {self.name}",
                )
        return self


LossName = Literal[
    "sparse_categorical_crossentropy",
    "categorical_crossentropy",
    "binary_crossentropy",
    "mean_squared_error",
    "mean_absolute_error",
    "huber",
    "log_cosh",
]
LOSS_ALIASES = {"mse": "mean_squared_error", "mae": "mean_absolute_error"}
# The arguments each built-in loss takes (Keras 3's own names).
LOSS_ARGUMENTS: dict[str, set[str]] = {
    "sparse_categorical_crossentropy": {"from_logits"},
    "categorical_crossentropy": {"from_logits", "label_smoothing"},
    "binary_crossentropy": {"from_logits", "label_smoothing"},
    "mean_squared_error": set(),
    "mean_absolute_error": set(),
    "huber": {"delta"},
    "log_cosh": set(),
}
REGRESSION_LOSSES = ("mean_squared_error", "mean_absolute_error", "huber", "log_cosh")


def _loss_object(value: Any) -> Any:
    if isinstance(value, str):
        value = {"name": value}
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        value = {**value, "name": LOSS_ALIASES.get(value["name"], value["name"])}
    return value


class LossSpec(StrictModel):
    """A Keras built-in loss by name (or ``{name, from_logits, label_smoothing, delta}``)."""

    name: LossName
    from_logits: bool | None = None
    label_smoothing: float | None = Field(default=None, ge=0, lt=1)
    delta: float | None = Field(default=None, gt=0, le=1e6, description="huber")

    @model_validator(mode="after")
    def _arguments_fit(self) -> LossSpec:
        for field in ("from_logits", "label_smoothing", "delta"):
            if getattr(self, field) is not None and field not in LOSS_ARGUMENTS[self.name]:
                raise PydanticCustomError(
                    "argument_not_for_loss", f"{field} is not an argument of {self.name}"
                )
        return self


MetricName = Literal[
    "accuracy",
    "sparse_categorical_accuracy",
    "categorical_accuracy",
    "binary_accuracy",
    "top_5_accuracy",
    "mean_squared_error",
    "mean_absolute_error",
    "root_mean_squared_error",
    "auc",
    "precision",
    "recall",
]


def _metric_name(value: Any) -> Any:
    return (
        {
            "mse": "mean_squared_error",
            "mae": "mean_absolute_error",
            "rmse": ("root_mean_squared_error"),
        }.get(value, value)
        if isinstance(value, str)
        else value
    )


class TrainingSpec(StrictModel):
    epochs: int = Field(default=5, ge=1, le=100_000)
    batch_size: int = Field(default=32, ge=1, le=65_536)
    steps_per_epoch: int | None = Field(default=None, ge=1, le=10**7)
    validation_split: float = Field(default=0.0, ge=0, le=0.5)
    seed: int = Field(default=0, ge=0, le=MAX_INT32)
    steps_per_execution: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="Steps run per graph execution; default chosen so the host syncs rarely.",
    )
    jit_compile: bool | Literal["auto"] = Field(
        default="auto",
        description="XLA-compile the train step. 'auto' is Keras' default: on with a GPU, off on "
        "a CPU-only worker.",
    )
    checkpoint_every: int = Field(
        default=1000, ge=1, le=10**9, description="Steps between resumable checkpoints."
    )
    target_loss: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="Record when the loss (mean of the last 50 steps) first reaches this.",
    )
    loss: Annotated[LossSpec, BeforeValidator(_loss_object)] = Field(
        default_factory=lambda: LossSpec(name="sparse_categorical_crossentropy"),
        description="A Keras built-in loss: a name (mse and mae are accepted) or "
        "{name, from_logits, label_smoothing, delta}.",
    )
    metrics: list[Annotated[MetricName, BeforeValidator(_metric_name)]] | None = Field(
        default=None,
        max_length=20,
        description="Keras built-in metrics by name; default: accuracy for classification "
        "losses, none for regression.",
    )


class FaultsSpec(StrictModel):
    """Rehearsal: inject failures so you see how a config reacts (and so tests can)."""

    nonfinite_at_steps: list[Annotated[int, Field(ge=0, le=10**9)]] = Field(
        default_factory=list,
        max_length=10_000,
        description="Global steps at which the child makes the gradients non-finite.",
    )
    nonfinite_variables: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list,
        max_length=100,
        description="Only the gradients of variables whose path contains one of these (e.g. "
        "'dense_0/kernel') are made non-finite; empty: all of them.",
    )
    crash_at_step: int | None = Field(
        default=None, ge=0, le=10**9, description="Raise an exception at this step."
    )
    hang_at_step: int | None = Field(
        default=None, ge=0, le=10**9, description="Stop making progress at this step."
    )
    crash_attempts: list[Annotated[int, Field(ge=1, le=1000)]] | None = Field(
        default=None,
        max_length=100,
        description="The attempts on which crash_at_step and hang_at_step happen (default: "
        "every attempt): [1] rehearses a crash and the resumed attempt that recovers from it.",
    )

    @field_validator("nonfinite_at_steps")
    @classmethod
    def _sorted_unique(cls, steps: list[int]) -> list[int]:
        return sorted(set(steps))


class GuardsSpec(StrictModel):
    """Stop a run that loss scaling cannot save; each guard can be switched off with null."""

    max_consecutive_nonfinite: int | None = Field(
        default=200,
        ge=1,
        le=10**9,
        description="Fail after this many non-finite (skipped) steps in a row.",
    )
    fail_on_nonfinite_loss: bool = Field(
        default=True,
        description="Fail when the loss is non-finite although the gradients were finite "
        "(loss scaling cannot explain it: the model itself diverged).",
    )
    max_steps_at_min_scale: int | None = Field(
        default=1000,
        ge=1,
        le=10**9,
        description="Fail when the scale has sat at min_scale this many steps in a row.",
    )
    overflow_warn_rate: float | None = Field(
        default=0.05, gt=0, le=1, description="Warn above this overflow rate; null: never."
    )
    overflow_window: int = Field(default=1000, ge=10, le=10**7)


class ForensicsSpec(StrictModel):
    captures: int = Field(
        default=1,
        ge=0,
        le=100,
        description="On the job's first N non-finite steps, record which variables had "
        "non-finite gradients, with the loss and the scale (0: off).",
    )


class GradientsSpec(StrictModel):
    """The gradient meter, which shows whether the loss scale does its job: how close this
    run's gradients come to float16's limits (small ones flushing to zero, large ones
    overflowing), sampled while it trains. A sample costs a fraction of a step and a shadow
    sample under one; only executions holding a sampled step run the metered step, so the
    defaults cost about 3% of a step (docs/results.md has the measured figures). Both periods 0
    take the meter out."""

    every: int = Field(
        default=250,
        ge=0,
        le=10**9,
        description="Record the gradient statistics (zero share, range, headroom below "
        "float16's largest value, subnormal share) at every step divisible by this; 0: only "
        "at shadow steps (both 0: the meter is off).",
    )
    shadow_every: int = Field(
        default=1000,
        ge=0,
        le=10**9,
        description="At every step divisible by this, also compute the same batch's gradient "
        "in float32 (the shadow, about one extra step each time) to measure what underflows "
        "at the current loss scale and what this run lost to zero; a shadow step is always "
        "sampled too. 0: no shadow.",
    )
    alarm_share: float | None = Field(
        default=0.05,
        gt=0,
        le=1,
        description="Warn when the underflow or lost share stays above this for alarm_samples "
        "shadow samples in a row; null: never.",
    )
    alarm_samples: int = Field(
        default=3,
        ge=1,
        le=10**6,
        description="Shadow samples in a row above alarm_share before the alarm fires.",
    )
    guard: bool = Field(
        default=False, description="Fail the job when an alarm fires, instead of only warning."
    )


class ResourcesSpec(StrictModel):
    gpus: int | Literal["auto"] = Field(
        default="auto",
        json_schema_extra={
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 64},
                {"type": "string", "enum": ["auto"]},
            ]
        },
        description="GPUs the job needs. 'auto': one when the worker has GPUs, else the CPU. "
        "0: CPU only.",
    )

    cpu_replicas: int = Field(
        default=1,
        ge=1,
        le=8,
        description="On a CPU worker, split the CPU into this many logical devices and train "
        "under MirroredStrategy: rehearse a multi-GPU job's data-parallel path without GPUs.",
    )

    @field_validator("gpus")
    @classmethod
    def _gpu_range(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 0 <= value <= 64:
            raise PydanticCustomError("gpu_range", "gpus must be between 0 and 64, or 'auto'")
        return value


class OutputsSpec(StrictModel):
    save_model: bool = Field(default=True, description="Save the trained model as .keras.")
    tensorboard: bool = Field(
        default=False, description="Also write per-step scalars for TensorBoard."
    )


class JobSpec(StrictModel):
    name: str | None = Field(default=None, min_length=1, max_length=200, pattern=NAME_PATTERN)
    priority: int = Field(default=50, ge=0, le=100, description="Higher runs first.")
    max_attempts: int = Field(default=3, ge=1, le=20)
    preemptible: bool = Field(
        default=True,
        description="A waiting job of higher priority, or of a user far below their share, "
        "may stop this one at a checkpoint; it resumes later exactly (docs/scheduling.md).",
    )
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    loss_scale: LossScaleSpec = Field(default_factory=LossScaleSpec)
    model: ModelSpec = Field(default_factory=MLPModel)
    data: DataSpec = Field(default_factory=SyntheticData)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    guards: GuardsSpec = Field(default_factory=GuardsSpec)
    faults: FaultsSpec = Field(default_factory=FaultsSpec)
    forensics: ForensicsSpec = Field(default_factory=ForensicsSpec)
    gradients: GradientsSpec = Field(default_factory=GradientsSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    outputs: OutputsSpec = Field(default_factory=OutputsSpec)
    code: CodeSpec | None = Field(
        default=None,
        description="Your own training code (a bundle's function); model and data must then "
        "be absent.",
    )

    @model_serializer(mode="wrap")
    def _code_replaces_model_and_data(
        self, handler: SerializerFunctionWrapHandler
    ) -> dict[str, Any]:
        # A code job has no model or data section (its function returns them), and a spec
        # without code stores exactly what it stored before code jobs existed.
        out: dict[str, Any] = handler(self)
        if self.code is None:
            out.pop("code", None)
        else:
            out.pop("model", None)
            out.pop("data", None)
        return out

    @model_validator(mode="before")
    @classmethod
    def _legacy_env(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keys = set(data)
            for env_key in ("env", "environment"):
                env = data.get(env_key)
                if isinstance(env, dict):
                    keys |= set(env)
            if any(str(k).upper() == LEGACY_AMP_ENV for k in keys):
                raise PydanticCustomError("legacy_env_var", LEGACY_AMP_EXPLANATION)
        return data


# --------------------------------------------------------------------------------------------
# Responses


class SubmitResult(BaseModel):
    """The normalized spec and what Halfway made of it (``dry_run`` returns only this)."""

    spec: JobSpec
    warnings: list[str]
    notes: list[str]


# --------------------------------------------------------------------------------------------
# Sweeps: one base spec, several precision variants, compared side by side


class VariantSpec(StrictModel):
    """What a variant changes in the base spec: its precision and/or loss scaling."""

    name: str | None = Field(default=None, min_length=1, max_length=100, pattern=NAME_PATTERN)
    # Merged into the base's sections, then validated with it; the OpenAPI document gives
    # them the sections' schemas (service/openapi.py).
    precision: dict[str, Any] | None = None
    loss_scale: dict[str, Any] | None = None


class SweepSpec(StrictModel):
    # JSON Schema can say "at least one variant, from either list": so it does.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {
                    "required": ["variants"],
                    "properties": {"variants": {"type": "array", "minItems": 1}},
                },
                {
                    "required": ["policies"],
                    "properties": {"policies": {"type": "array", "minItems": 1}},
                },
            ]
        }
    )

    # Each job is named '<sweep>/<variant>' (variant names are up to 100 characters) and a job
    # name holds at most 200.
    name: str | None = Field(default=None, min_length=1, max_length=99, pattern=NAME_PATTERN)
    base: dict[str, Any] = Field(
        default_factory=dict,
        description="A job spec; every variant uses its model, data, seed and training.",
    )
    variants: list[VariantSpec] = Field(default_factory=list, max_length=20)
    policies: list[PolicyName] | None = Field(
        default=None,
        max_length=10,
        description="Shorthand: one variant per policy name.",
    )
    target_loss: float | None = Field(
        default=None, gt=0, le=1e6, description="Measure each variant's time to this loss."
    )

    @model_validator(mode="after")
    def _some_variants(self) -> SweepSpec:
        if self.policies:
            self.variants = [
                *self.variants,
                *(VariantSpec(name=p, precision={"policy": p}) for p in self.policies),
            ]
            self.policies = None
        if len(self.variants) < 1:
            raise PydanticCustomError(
                "no_variants", "give at least one variant (variants or policies)"
            )
        if len(self.variants) > 20:
            raise PydanticCustomError("too_many_variants", "at most 20 variants")
        return self
