"""One job's training, inside the training child: choose the plan (arrays, or the user's
code), resume, fit epoch by epoch with the step stream, and end. The only module tree that
imports TensorFlow (through ``workers.trainer``, ``workers.recording``, ``workers.scaler``,
``workers.builders``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from workers import autoprecision
from workers import data as data_mod
from workers.builders import precision_report
from workers.checkpointer import Checkpointer
from workers.context import RunContext, disk_errors_explained
from workers.devices import (
    configure_devices,
    configure_graph_rewrite,
    make_strategy,
)
from workers.feed import EpochFeed
from workers.guards import Guards
from workers.protocol import JobError
from workers.stream import StepStream
from workers.trainer import Built, Plan, build_trainer, executions, save_keras


def train(ctx: RunContext) -> str:
    """Run the job to completion. Returns 'succeeded' or 'cancelled'; raises JobError (or any
    exception) on failure."""
    spec = ctx.spec
    training = spec["training"]
    ctx.job_dir.mkdir(parents=True, exist_ok=True)
    keras.utils.set_random_seed(training["seed"])
    device = configure_devices(ctx)
    rewrite = configure_graph_rewrite(spec["precision"]["graph_rewrite"])
    if rewrite:
        device["graph_rewrite"] = rewrite
    strategy = make_strategy()

    def plan_for(run: RunContext) -> Plan:
        if spec.get("code"):
            from workers.usercode import plan_code_job

            return plan_code_job(run, device, strategy, graph_rewrite=rewrite is not None)
        return _plan_arrays(run, device, strategy, graph_rewrite=rewrite is not None)

    if spec["precision"]["policy"] == "auto":
        ctx = _decided(ctx, plan_for)
        spec = ctx.spec
    return run_plan(ctx, plan_for(ctx), device)


def _decided(ctx: RunContext, plan_for: Callable[[RunContext], Plan]) -> RunContext:
    """Policy 'auto': probe and choose (or take the choice an earlier attempt recorded, so a
    resumed attempt builds the same model), then train as if the spec had named it."""
    decision: Any = ctx.precision_decision
    if decision is None:
        decision = autoprecision.choose(ctx, plan_for)
        ctx.emit({"type": "decision", "decision": decision})
        print(f"halfway: precision auto chose {decision['policy']}: {decision['reason']}")
    # The run starts from the seed as a job naming this policy would, probes or none.
    keras.utils.set_random_seed(ctx.spec["training"]["seed"])
    spec = autoprecision.with_policy(ctx.spec, decision["policy"])
    return dataclasses.replace(ctx, spec=spec)


def _plan_arrays(
    ctx: RunContext,
    device: dict[str, Any],
    strategy: tf.distribute.Strategy | None,
    *,
    graph_rewrite: bool,
) -> Plan:
    """A preset or Keras-config model on the spec's data, loaded into arrays: the batch
    order is Halfway's (a function of seed and epoch), so a resume is exact."""
    spec, training = ctx.spec, ctx.spec["training"]
    arrays = data_mod.load_arrays(spec["data"], training, ctx.data_dir)
    n_train = len(arrays.x_train)
    fixed_steps = training.get("steps_per_epoch")
    batch = training["batch_size"]
    per_epoch = data_mod.steps_per_epoch(n_train, batch, fixed_steps)
    spe = executions(training, per_epoch, strategy, device)
    built = build_trainer(
        spec,
        arrays.sample_shape,
        arrays.num_classes,
        spe,
        graph_rewrite=graph_rewrite,
        strategy=strategy,
        max_parameters=ctx.max_parameters,
    )
    x_all = tf.constant(arrays.x_train)
    y_all = tf.constant(arrays.y_train)
    feeds: list[EpochFeed] = []

    def epoch_data(epoch: int, skip: int) -> Any:
        order = data_mod.epoch_indices(n_train, batch, fixed_steps, training["seed"], epoch)
        if not feeds:
            feeds.append(EpochFeed(x_all, y_all, batch, len(order)))
        return feeds[0].epoch(order, skip)

    validation = (arrays.x_val, arrays.y_val) if arrays.x_val is not None else None
    return Plan(built, per_epoch, spe, epoch_data, validation, batch)


def run_plan(ctx: RunContext, plan: Plan, device: dict[str, Any]) -> str:
    """Resume, fit epoch by epoch with the step stream, and end: the part every job shares."""
    spec, training = ctx.spec, ctx.spec["training"]
    built, per_epoch = plan.built, plan.per_epoch
    model, trainer, recorder = built.model, built.trainer, built.recorder
    epochs = training["epochs"]
    total = per_epoch * epochs

    checkpointer = Checkpointer(ctx.job_dir)
    start = ctx.resume_step or 0
    # Only a committed checkpoint, whole and as committed, is resumed from: the staging put
    # it in job_dir after checking it against its marker. Without one, the supervisor sees
    # start_step 0 in "started" and records why in the job.
    if start and not checkpointer.path(start).is_file():
        print(f"halfway: checkpoint for step {start} is missing; starting over", flush=True)
        start = 0
    progress = checkpointer.restore(trainer, start) if start else None
    recorder.set_start(start)
    if trainer.meter is not None:
        trainer.meter.ends_at = total
    trainer.on_compile = lambda what: ctx.emit({"type": "compiling", "what": what})
    ls = spec["loss_scale"]
    guards = Guards(spec["guards"], ls["min_scale"] if ls["mode"] == "dynamic" else None)
    stream = StepStream(
        ctx,
        recorder,
        guards,
        checkpointer,
        training["checkpoint_every"],
        plan.batch_size or training["batch_size"],
    )
    stream.steps_per_epoch = per_epoch
    if progress is not None:
        stream.resume(progress)
    if spec.get("outputs", {}).get("tensorboard"):
        stream.tensorboard = tf.summary.create_file_writer(str(ctx.job_dir / "tensorboard"))

    device["jit_compile"] = bool(trainer.jit_compile)
    device.update(trained_with(built, plan.batch_size or training["batch_size"]))
    ctx.emit(
        {
            "type": "started",
            "total_steps": total,
            "steps_per_epoch": per_epoch,
            "start_step": start,
            "steps_per_execution": plan.steps_per_execution,
            "precision_report": precision_report(model),
            "device": device,
        }
    )
    if start and plan.resume_note is not None:
        note = plan.resume_note(start // per_epoch, start % per_epoch)
        if note:
            ctx.emit({"type": "note", "message": note})

    for epoch in range(start // per_epoch, epochs):
        skip = start % per_epoch if epoch == start // per_epoch else 0
        try:
            trainer.fit(
                plan.epoch_data(epoch, skip),
                epochs=epoch + 1,
                initial_epoch=epoch,
                verbose=0,
                shuffle=False,  # the batch order is the plan's
                callbacks=[*plan.callbacks, stream],
                validation_data=plan.validation,
                validation_batch_size=plan.validation_batch_size,
            )
        except Exception as exc:
            blamed = plan.blame(exc) if plan.blame is not None else None
            if blamed is None:
                raise
            raise blamed from exc
        if trainer.stop_training:
            break

    stream.collect()
    stream.flush()
    if stream.failure is not None:
        raise JobError(stream.failure)
    if stream.stopped_by_signal:
        # The periodic checkpoint may already have saved this very step.
        if recorder.drained_to != stream.last_checkpoint:
            stream.checkpoint()
        return "cancelled"
    timing = stream.timing()
    timing.update(_peak_memory())
    # Updates the inner optimizer applied: the steps that were not skipped.
    timing["updates_applied"] = float(int(built.optimizer.iterations.numpy()))
    ctx.emit({"type": "metrics", "epoch": -1, "metrics": timing})
    if spec["outputs"]["save_model"]:
        with disk_errors_explained(ctx.job_dir):
            if plan.save is not None:
                saved = plan.save(ctx.job_dir)
            else:
                save_keras(model, ctx.job_dir / "model.keras")
                saved = ["model.keras"]
        ctx.emit({"type": "saved", "names": saved})  # the supervisor puts them in the store
    return "succeeded"


def trained_with(built: Built, batch_size: int) -> dict[str, Any]:
    """What the job trains with, for ``halfway show``: a code job's function may return its
    own optimizer, learning-rate schedule and loss, which the spec does not say."""
    loss = built.trainer.loss
    name = loss if isinstance(loss, str) else getattr(loss, "name", None)
    name = name or getattr(loss, "__name__", None) or type(loss).__name__
    return {
        "optimizer": _optimizer_report(built.optimizer),
        "loss": str(name),
        "batch_size": int(batch_size),
    }


def _optimizer_report(optimizer: keras.optimizers.Optimizer) -> dict[str, Any]:
    """The optimizer's class and its learning rate, or its schedule's class and scalars."""
    report: dict[str, Any] = {"class": type(optimizer).__name__}
    try:
        rate = optimizer.get_config().get("learning_rate")
    except Exception:  # a custom optimizer or schedule that cannot say its config
        return report
    if isinstance(rate, dict):
        config = rate.get("config") or {}
        report["schedule"] = {
            "class": str(rate.get("class_name")),
            **{
                k: v
                for k, v in config.items()
                if k != "name" and isinstance(v, str | int | float | bool)
            },
        }
    elif isinstance(rate, int | float):
        report["learning_rate"] = float(rate)
    return report


def _peak_memory() -> dict[str, float]:
    if not tf.config.list_physical_devices("GPU"):
        return {}
    try:
        return {"peak_memory_bytes": float(tf.config.experimental.get_memory_info("GPU:0")["peak"])}
    except (ValueError, RuntimeError):
        return {}
