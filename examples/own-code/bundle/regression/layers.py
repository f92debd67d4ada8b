"""A layer with weights of its own: a dense projection whose outputs each pass a learned
sigmoid gate."""

from __future__ import annotations

from typing import Any

import keras


@keras.saving.register_keras_serializable(package="regression")
class GatedDense(keras.layers.Layer):
    def __init__(self, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape: Any) -> None:
        width = int(input_shape[-1])
        self.kernel = self.add_weight(
            shape=(width, self.units), initializer="glorot_uniform", name="kernel"
        )
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")
        self.gate = self.add_weight(shape=(self.units,), initializer="ones", name="gate")

    def call(self, x: Any) -> Any:
        # Under mixed_float16 Keras hands call() the weights cast to float16.
        y = keras.ops.matmul(x, self.kernel) + self.bias
        return y * keras.ops.sigmoid(self.gate)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "units": self.units}
