"""What a job trains: a preset model, a Keras config, or the team's own code; and the data it
trains on."""

from __future__ import annotations

import itertools
import json
from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from service.specs.modelconfig import check_model_config
from service.specs.schemas.base import MAX_INT32, StrictModel

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
    service/specs/modelconfig.py lists."""

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
