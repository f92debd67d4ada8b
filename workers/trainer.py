"""The trainer a job runs, inside the training child: Halfway's wrapped Keras model
(``build_trainer`` for a preset or Keras config, ``compile_trainer`` for a model already
built, such as a code job's), a job's ``Plan`` (what it trains, epoch by epoch), the steps
per graph execution, saving a model, and the scaler's state. ``workers.training`` runs a
plan; ``workers.usercode`` makes one from the user's code."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from workers.builders import build_model, build_optimizer
from workers.gradients import GradientMeter
from workers.losses import build_loss, spec_metrics
from workers.recording import HalfwayTrainer, OverflowForensics, StepRecorder
from workers.scaler import HalfwayLossScaleOptimizer, make_scaler

DEFAULT_STEPS_PER_EXECUTION = 64


@dataclass
class Built:
    """A job's Keras objects, as ``train`` wires them: ``model`` is the user's model (what
    gets saved), ``optimizer`` the inner optimizer, ``trainer`` the model that fits."""

    model: keras.Model
    optimizer: keras.optimizers.Optimizer
    scaler: HalfwayLossScaleOptimizer | None
    recorder: StepRecorder
    trainer: HalfwayTrainer


def build_trainer(
    spec: dict[str, Any],
    sample_shape: tuple[int, ...],
    num_classes: int,
    steps_per_execution: int,
    *,
    graph_rewrite: bool = False,
    strategy: tf.distribute.Strategy | None = None,
    max_parameters: int | None = None,
) -> Built:
    """The model, optimizer, scaler and recorder of a (normalized) spec, compiled and built
    (under ``strategy`` when given; the recorder stays outside it, see StepRecorder)."""
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        keras.config.set_dtype_policy(spec["precision"]["policy"])
        try:
            model = build_model(spec, sample_shape, num_classes, max_parameters)
        finally:
            keras.config.set_dtype_policy("float32")
    return compile_trainer(
        spec, model, steps_per_execution, graph_rewrite=graph_rewrite, strategy=strategy
    )


def compile_trainer(
    spec: dict[str, Any],
    model: keras.Model,
    steps_per_execution: int,
    *,
    optimizer: keras.optimizers.Optimizer | None = None,
    loss: Any = None,
    metrics: list[Any] | None = None,
    graph_rewrite: bool = False,
    strategy: tf.distribute.Strategy | None = None,
) -> Built:
    """Wrap a built model (a preset's or the user's) in Halfway's trainer: its optimizer in
    the loss scaler, the recorder, faults and forensics. ``optimizer``, ``loss`` and
    ``metrics`` default to the spec's."""
    recorder = StepRecorder(capacity=steps_per_execution)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        if optimizer is None:
            optimizer = build_optimizer(spec["optimizer"])
        scaler = make_scaler(optimizer, spec["loss_scale"])
        trainer = HalfwayTrainer(
            model,
            recorder,
            fault_steps=spec["faults"]["nonfinite_at_steps"],
            fault_variables=spec["faults"].get("nonfinite_variables"),
        )
        jit: bool | str = spec["training"].get("jit_compile", "auto")
        if graph_rewrite:
            jit = False  # XLA clusters bypass grappler, so the rewrite would not apply
        training = spec["training"]
        trainer.compile(
            optimizer=scaler or optimizer,
            loss=loss if loss is not None else build_loss(training.get("loss") or _SPARSE_CE),
            metrics=metrics if metrics is not None else spec_metrics(training),
            steps_per_execution=steps_per_execution,
            jit_compile=jit,
            auto_scale_loss=False,
        )
        # Build the optimizer (and the scaler's variables) now, not lazily inside the first
        # traced step: the train step reads the scale, and a checkpoint restores into them.
        trainer.optimizer.build(trainer.trainable_variables)
    # Outside the strategy, like the recorder: host-read variables the first replica writes.
    captures = int(spec.get("forensics", {}).get("captures", 1))
    trainer.forensics = OverflowForensics(trainer.trainable_variables, captures)
    # A spec stored before gradient samples existed has no section: no meter.
    sampling = spec.get("gradients") or {}
    if sampling.get("every") or sampling.get("shadow_every"):
        trainer.meter = GradientMeter(
            trainer.trainable_variables,
            int(sampling["every"]),
            int(sampling["shadow_every"]),
            steps_per_execution,
        )
    return Built(model, optimizer, scaler, recorder, trainer)


_SPARSE_CE = {"name": "sparse_categorical_crossentropy"}


@dataclass
class Plan:
    """What a job trains: its wrapped model, the steps of an epoch, and each epoch's batches
    (``epoch_data(epoch, skip)`` leaves out the first ``skip`` batches, for a resume)."""

    built: Built
    per_epoch: int
    steps_per_execution: int
    epoch_data: Callable[[int, int], Any]
    validation: Any = None
    validation_batch_size: int | None = None
    callbacks: list[Any] = field(default_factory=list)
    save: Callable[[Path], list[str]] | None = None  # the files it wrote
    resume_note: Callable[[int, int], str | None] | None = None
    # Turns an exception raised in fit() into the job's own error (no retry), or None.
    blame: Callable[[Exception], Exception | None] | None = None
    batch_size: int | None = None  # examples per step, when not training.batch_size


def executions(
    training: dict[str, Any],
    per_epoch: int,
    strategy: tf.distribute.Strategy | None,
    device: dict[str, Any],
) -> int:
    """Steps per graph execution: the spec's, or as many as fit the ring buffer's default
    (capped by the epoch); one under MirroredStrategy."""
    spe: int = training.get("steps_per_execution") or min(DEFAULT_STEPS_PER_EXECUTION, per_epoch)
    if strategy is not None:
        device["replicas"] = strategy.num_replicas_in_sync
        if spe > 1:
            # Keras 3's multi-step loop cannot run a loss-scale optimizer's merge_call under
            # MirroredStrategy (it fails with an unfed placeholder, stock LossScaleOptimizer
            # included), so a distributed job runs one step per execution; every step is
            # still recorded, drained after each one.
            device["warnings"].append(
                f"steps_per_execution {spe} -> 1 under MirroredStrategy "
                f"({strategy.num_replicas_in_sync} replicas)"
            )
            spe = 1
    return spe


def save_keras(model: keras.Model, target: Path) -> None:
    """Written beside and renamed into place, so a reader never sees half a model."""
    partial = target.with_name(target.stem + ".partial.keras")
    model.save(partial)
    os.replace(partial, target)


def scaler_state(optimizer: Any) -> dict[str, float] | None:
    if not isinstance(optimizer, HalfwayLossScaleOptimizer) or not optimizer.built:
        return None
    return {
        "scale": float(optimizer.scale.numpy()),
        "good_steps": int(optimizer.step_counter.numpy()),
        "hysteresis_left": int(optimizer.hysteresis_left.numpy()),
    }
