"""The entry point Halfway calls: build(args) returns the model and its data.

Halfway has already set the job's precision policy (so every layer built here computes in
float16 under mixed_float16), the seeds and, on several GPUs, the strategy's scope. It wraps
the optimizer returned here in its loss scaler and records every step."""

from __future__ import annotations

from typing import Any

import keras

from regression.data import pipeline
from regression.layers import GatedDense


def build(args: dict[str, Any]) -> dict[str, Any]:
    features = int(args.get("features", 8))
    batch_size = int(args.get("batch_size", 32))
    inputs = keras.Input(shape=(features,), name="x")
    h = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    h = GatedDense(16, name="gated")(h)
    h = keras.layers.Activation("relu", name="gated_relu")(h)
    # The regression output in float32, as the mixed-precision guide advises for outputs.
    outputs = keras.layers.Dense(1, dtype="float32", name="y")(h)
    model = keras.Model(inputs, outputs, name="gated_regressor")

    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        warmup_target=float(args.get("learning_rate", 0.01)),
        warmup_steps=int(args.get("warmup_steps", 10)),
        decay_steps=int(args.get("decay_steps", 100)),
        alpha=0.05,
    )
    return {
        "model": model,
        "train": pipeline(args["train"], features, batch_size),
        "validation": pipeline(args["validation"], features, batch_size)
        if args.get("validation")
        else None,
        "loss": "mse",
        "metrics": [keras.metrics.MeanAbsoluteError(name="mae")],
        "optimizer": keras.optimizers.Adam(learning_rate=schedule),
    }
