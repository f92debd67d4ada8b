"""A spec's loss, metrics and learning-rate schedule as Keras objects (training child only)."""

from __future__ import annotations

from typing import Any

import keras

REGRESSION = ("mean_squared_error", "mean_absolute_error", "huber", "log_cosh")

_LOSSES: dict[str, Any] = {
    "sparse_categorical_crossentropy": keras.losses.SparseCategoricalCrossentropy,
    "categorical_crossentropy": keras.losses.CategoricalCrossentropy,
    "binary_crossentropy": keras.losses.BinaryCrossentropy,
    "mean_squared_error": keras.losses.MeanSquaredError,
    "mean_absolute_error": keras.losses.MeanAbsoluteError,
    "huber": keras.losses.Huber,
    "log_cosh": keras.losses.LogCosh,
}


def build_loss(loss: dict[str, Any]) -> keras.losses.Loss:
    kwargs = {
        k: loss[k] for k in ("from_logits", "label_smoothing", "delta") if loss.get(k) is not None
    }
    built: keras.losses.Loss = _LOSSES[loss["name"]](**kwargs)
    return built


def default_metrics(loss_name: str) -> list[str]:
    """What a job reports when its spec names no metrics: accuracy of the kind the loss
    implies, nothing for a regression (its loss is the measure)."""
    return {
        "sparse_categorical_crossentropy": ["sparse_categorical_accuracy"],
        "categorical_crossentropy": ["categorical_accuracy"],
        "binary_crossentropy": ["binary_accuracy"],
    }.get(loss_name, [])


def build_metrics(names: list[str], loss_name: str) -> list[keras.metrics.Metric]:
    """Named metrics; ``accuracy`` (and the default accuracy) is reported as ``accuracy``,
    of the kind that fits the loss."""
    out: list[keras.metrics.Metric] = []
    for name in names:
        if name in (
            "accuracy",
            "sparse_categorical_accuracy",
            "categorical_accuracy",
            "binary_accuracy",
        ):
            kind = name if name != "accuracy" else (default_metrics(loss_name) or ["accuracy"])[0]
            cls = {
                "sparse_categorical_accuracy": keras.metrics.SparseCategoricalAccuracy,
                "categorical_accuracy": keras.metrics.CategoricalAccuracy,
                "binary_accuracy": keras.metrics.BinaryAccuracy,
                "accuracy": keras.metrics.Accuracy,
            }[kind]
            out.append(cls(name="accuracy" if name == "accuracy" else name))
        elif name == "top_5_accuracy":
            out.append(keras.metrics.SparseTopKCategoricalAccuracy(k=5, name=name))
        elif name == "mean_squared_error":
            out.append(keras.metrics.MeanSquaredError(name="mse"))
        elif name == "mean_absolute_error":
            out.append(keras.metrics.MeanAbsoluteError(name="mae"))
        elif name == "root_mean_squared_error":
            out.append(keras.metrics.RootMeanSquaredError(name="rmse"))
        elif name == "auc":
            out.append(keras.metrics.AUC(name="auc"))
        elif name == "precision":
            out.append(keras.metrics.Precision(name="precision"))
        elif name == "recall":
            out.append(keras.metrics.Recall(name="recall"))
        else:
            raise ValueError(f"unknown metric {name!r}")
    return out


def spec_metrics(training: dict[str, Any]) -> list[keras.metrics.Metric]:
    loss_name = training.get("loss", {}).get("name", "sparse_categorical_crossentropy")
    names = training.get("metrics")
    if names is None:
        # The default: a classifier reports 'accuracy', as it always has.
        names = ["accuracy"] if default_metrics(loss_name) else []
    return build_metrics(names, loss_name)


@keras.saving.register_keras_serializable(package="halfway")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):  # type: ignore[misc]
    """A linear warm-up from 0 to ``peak`` over ``warmup_steps``, then ``after`` (counted from
    the end of the warm-up). Registered, so a saved model's optimizer loads again."""

    def __init__(self, peak: float, warmup_steps: int, after: Any) -> None:
        self.peak, self.warmup_steps, self.after = peak, warmup_steps, after

    def __call__(self, step: Any) -> Any:
        step = keras.ops.cast(step, "float32")
        warm = self.peak * (step + 1.0) / float(self.warmup_steps)
        rest = self.after(keras.ops.maximum(step - float(self.warmup_steps), 0.0))
        return keras.ops.where(step < float(self.warmup_steps), warm, rest)

    def get_config(self) -> dict[str, Any]:
        return {
            "peak": self.peak,
            "warmup_steps": self.warmup_steps,
            "after": keras.saving.serialize_keras_object(self.after),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LinearWarmup:
        after = keras.saving.deserialize_keras_object(config["after"])
        return cls(config["peak"], config["warmup_steps"], after)


@keras.saving.register_keras_serializable(package="halfway")
class Constant(keras.optimizers.schedules.LearningRateSchedule):  # type: ignore[misc]
    def __init__(self, rate: float) -> None:
        self.rate = rate

    def __call__(self, step: Any) -> Any:
        return keras.ops.cast(self.rate, "float32") + 0.0 * keras.ops.cast(step, "float32")

    def get_config(self) -> dict[str, Any]:
        return {"rate": self.rate}


def build_schedule(opt: dict[str, Any]) -> float | keras.optimizers.schedules.LearningRateSchedule:
    """The optimizer's learning rate: a float for a constant rate without warm-up (as
    before), else a schedule of the optimizer's step (steps whose update was applied: a step
    skipped for non-finite gradients does not advance it)."""
    rate = float(opt["learning_rate"])
    schedule = opt.get("schedule") or {"kind": "constant", "warmup_steps": 0}
    kind, warmup = schedule["kind"], int(schedule.get("warmup_steps") or 0)
    after: Any
    if kind == "constant":
        if not warmup:
            return rate
        after = Constant(rate)
    elif kind == "cosine_decay":
        after = keras.optimizers.schedules.CosineDecay(
            rate, schedule["decay_steps"], alpha=schedule.get("alpha") or 0.0
        )
    elif kind == "exponential_decay":
        after = keras.optimizers.schedules.ExponentialDecay(
            rate,
            schedule["decay_steps"],
            schedule["decay_rate"],
            staircase=bool(schedule.get("staircase")),
        )
    elif kind == "piecewise_constant":
        after = keras.optimizers.schedules.PiecewiseConstantDecay(
            list(schedule["boundaries"]), [float(v) for v in schedule["values"]]
        )
        rate = float(schedule["values"][0])
    else:
        raise ValueError(f"unknown schedule {kind!r}")
    return LinearWarmup(rate, warmup, after) if warmup else after
