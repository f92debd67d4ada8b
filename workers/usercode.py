"""A code job in the training child: import the user's function from its bundle, call it
under the job's policy, seeds and strategy scope, check what it returned, and hand Halfway's
trainer its model and data (``workers.training.run_plan`` does the rest, exactly as for a
preset: loss scaler, per-step record, guards, forensics, faults, checkpoints).

The bundle's root goes on ``sys.path`` here and nowhere else: the API and the supervisor only
ever parse it (``service/files/code.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from workers import data as data_mod
from workers.context import RunContext
from workers.feed import EpochFeed
from workers.protocol import JobError
from workers.trainer import Built, Plan, compile_trainer, executions, save_keras

KEYS = ("model", "train", "validation", "loss", "metrics", "optimizer", "callbacks")


class UserCodeError(JobError):
    """An exception raised in the user's code: it would fail again, so no retry."""


def bundle_root(ctx: RunContext) -> Path:
    """The bundle's tree in this host's cache, where the child's staging put it (fetched from
    the store and checked against its digest: ``workers.staging.code_dir_for``)."""
    if ctx.code_dir is None:
        raise JobError("this worker has no code directory (HALFWAY_CODE_DIR)")
    digest: str = ctx.spec["code"]["bundle"]
    root = ctx.code_dir / digest.removeprefix("sha256:")
    if not root.is_dir():
        raise JobError(f"code bundle {digest} was not staged in {ctx.code_dir}")
    return root


def innermost_bundle_frame(exc: BaseException, root: Path) -> str | None:
    """``file:line`` (relative to the bundle) of the deepest frame inside the bundle: in the
    traceback, else in the message (TensorFlow names the op's Python origin there when the
    error surfaces from a graph)."""
    root_text = str(root)
    found: str | None = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith(root_text + os.sep):
            found = f"{Path(frame.filename).relative_to(root)}:{frame.lineno}"
    if found is not None:
        return found
    pattern = re.compile(r'File "' + re.escape(root_text + os.sep) + r'([^"]+)", line (\d+)')
    matches = pattern.findall(str(exc))
    if matches:
        path, line = matches[-1]
        return f"{path}:{line}"
    cause = exc.__cause__ or exc.__context__
    return innermost_bundle_frame(cause, root) if cause is not None else None


def user_error(exc: BaseException, root: Path, during: str) -> UserCodeError:
    """The job's error: the exception's type and message and where in the bundle it came
    from; the whole traceback goes to the job's log."""
    traceback.print_exception(exc)
    sys.stderr.flush()
    where = innermost_bundle_frame(exc, root)
    # Keras wraps a layer's exception in a few lines of context: keep them, on one line.
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(message) > 600:
        message = message[:600] + "..."
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    place = f" at {where}" if where else ""
    return UserCodeError(f"{text} ({during}{place}; the full traceback is in the job's log)")


@contextlib.contextmanager
def blame_user(root: Path, during: str) -> Iterator[None]:
    try:
        yield
    except JobError:
        raise
    except (Exception, SystemExit) as exc:  # a sys.exit() in user code is theirs too
        raise user_error(exc, root, during) from exc


def load_function(root: Path, entrypoint: str) -> Callable[..., Any]:
    module_name, _, function = entrypoint.partition(":")
    sys.dont_write_bytecode = True  # the bundle is read-only
    sys.path.insert(0, str(root))
    with blame_user(root, f"importing {module_name}"):
        module = importlib.import_module(module_name)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise JobError(f"code.entrypoint: {module_name} has no function {function!r}")
    return fn  # type: ignore[no-any-return]


def call_function(ctx: RunContext, strategy: tf.distribute.Strategy | None) -> Mapping[str, Any]:
    """Call the user's function with the job's policy set, inside the strategy's scope (so
    its variables are mirrored), with the data directory as the working directory."""
    code = ctx.spec["code"]
    root = bundle_root(ctx)
    os.environ["HALFWAY_DATA_DIR"] = str(ctx.data_dir)
    with contextlib.suppress(OSError):
        os.chdir(ctx.data_dir)
    fn = load_function(root, code["entrypoint"])
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        keras.config.set_dtype_policy(ctx.spec["precision"]["policy"])
        try:
            with blame_user(root, f"in {code['entrypoint']}"):
                result = fn(code.get("args") or {})
        finally:
            keras.config.set_dtype_policy("float32")
    if not isinstance(result, Mapping):
        raise JobError(
            f"{code['entrypoint']} returned {type(result).__name__}; it must return a mapping "
            "with 'model' and 'train' (and optionally " + ", ".join(KEYS[2:]) + ")"
        )
    return result


# --------------------------------------------------------------------------------------------
# What the function returned


def _is_arrays(value: Any) -> bool:
    return (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(isinstance(v, np.ndarray) for v in value)
        and len(value[0]) == len(value[1])
    )


def _data(value: Any, key: str) -> Any:
    if isinstance(value, tf.data.Dataset):
        return value
    if _is_arrays(value):
        return tuple(value)
    raise JobError(
        f"returned {key!r} must be a tf.data.Dataset of (x, y) or (x, y, sample_weight), or "
        f"numpy arrays (x, y) of equal length; got {type(value).__name__}"
    )


def checked(result: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(result) - set(KEYS))
    if unknown:
        raise JobError(f"the returned mapping has unknown keys {unknown}; known: {list(KEYS)}")
    for key in ("model", "train"):
        if result.get(key) is None:
            raise JobError(f"the returned mapping lacks {key!r}")
    out = dict(result)
    if not isinstance(out["model"], keras.Model):
        raise JobError(f"returned 'model' must be a keras.Model, got {type(out['model']).__name__}")
    out["train"] = _data(out["train"], "train")
    if out.get("validation") is not None:
        out["validation"] = _data(out["validation"], "validation")
    loss = out.get("loss")
    if loss is not None and not (isinstance(loss, str) or callable(loss)):
        raise JobError(f"returned 'loss' must be a name or a Keras loss, got {type(loss).__name__}")
    metrics = out.get("metrics")
    if metrics is not None and not isinstance(metrics, list | tuple):
        raise JobError("returned 'metrics' must be a list of names or Keras metrics")
    optimizer = out.get("optimizer")
    if optimizer is not None:
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise JobError(
                "returned 'optimizer' is already a LossScaleOptimizer: return the plain "
                "optimizer, Halfway wraps it in its own loss scaler (loss_scale in the spec)"
            )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise JobError(
                f"returned 'optimizer' must be a keras optimizer, got {type(optimizer).__name__}"
            )
    callbacks = out.get("callbacks")
    if callbacks is not None and not (
        isinstance(callbacks, list | tuple)
        and all(isinstance(c, keras.callbacks.Callback) for c in callbacks)
    ):
        raise JobError("returned 'callbacks' must be a list of keras.callbacks.Callback")
    return out


# --------------------------------------------------------------------------------------------
# The plan


def _count_batches(dataset: tf.data.Dataset, root: Path) -> int:
    cardinality = int(dataset.cardinality().numpy())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise JobError("returned 'train' repeats forever: set training.steps_per_epoch in the spec")
    if cardinality >= 0:
        return cardinality
    with blame_user(root, "counting the batches of 'train'"):
        return int(dataset.reduce(np.int64(0), lambda n, _: n + 1).numpy())


def plan_code_job(
    ctx: RunContext,
    device: dict[str, Any],
    strategy: tf.distribute.Strategy | None,
    *,
    graph_rewrite: bool,
) -> Plan:
    spec, training = ctx.spec, ctx.spec["training"]
    root = bundle_root(ctx)
    result = checked(call_function(ctx, strategy))
    model: keras.Model = result["model"]
    train = result["train"]
    batch = training["batch_size"]
    fixed = training.get("steps_per_epoch")
    notes: list[str] = []

    if isinstance(train, tf.data.Dataset):
        counted = fixed is None and int(train.cardinality().numpy()) < 0
        per_epoch = fixed or _count_batches(train, root)
        if per_epoch < 1:
            raise JobError("returned 'train' has no batches")
        if counted:
            notes.append(
                f"tf.data could not tell the length of 'train'; Halfway counted it by "
                f"iterating it once: {per_epoch} batches per epoch (set training."
                "steps_per_epoch to skip this)"
            )
        if counted:
            # Keras then knows the epoch's length too (and a wrong count fails loudly).
            train = train.apply(tf.data.experimental.assert_cardinality(per_epoch))
        epoch_data = _dataset_epochs(train, per_epoch, fixed is not None)
        sample = next(iter(train.take(1)))
        resume_note: Callable[[int, int], str | None] | None = _dataset_resume_note
    else:
        x, y = train
        per_epoch = data_mod.steps_per_epoch(len(x), batch, fixed)
        feed = EpochFeed(tf.constant(x), tf.constant(y), batch, 0)
        epoch_data = _array_epochs(feed, len(x), batch, fixed, training["seed"])
        sample = (x[:batch], y[:batch])
        resume_note = None
    if not model.built:
        with blame_user(root, "building the model on a first batch"):
            model(sample[0])
    if ctx.max_parameters is not None and model.count_params() > ctx.max_parameters:
        raise JobError(
            f"the model has {model.count_params()} parameters; the server's limit is "
            f"{ctx.max_parameters} (HALFWAY_MAX_PARAMETERS)"
        )
    spe = executions(training, per_epoch, strategy, device)
    metrics = result.get("metrics")
    if metrics is None and result.get("loss") is not None:
        metrics = training.get("metrics") or []
    built = compile_trainer(
        spec,
        model,
        spe,
        optimizer=result.get("optimizer"),
        loss=result.get("loss"),
        metrics=list(metrics) if metrics is not None else None,
        graph_rewrite=graph_rewrite,
        strategy=strategy,
    )
    for note in notes:
        ctx.emit({"type": "note", "message": note})
    validation = result.get("validation")
    return Plan(
        built,
        per_epoch,
        spe,
        _blaming(epoch_data, root),
        validation,
        batch if isinstance(validation, tuple) else None,
        callbacks=list(result.get("callbacks") or []),
        save=lambda job_dir: _save(built, job_dir, ctx),
        resume_note=resume_note,
        blame=lambda exc: _training_error(exc, root),
        batch_size=_batch_size(sample[0]),
    )


def _batch_size(x: Any) -> int | None:
    """Examples in the first batch (the pipeline's own batch size, for examples/s)."""
    first = tf.nest.flatten(x)[0]
    size = first.shape[0] if len(first.shape) else None
    return int(size) if size is not None else None


def _training_error(exc: Exception, root: Path) -> JobError | None:
    """A failure during fit() is the user's when it came from their code (a frame of the
    bundle); anything else stays Halfway's (and may be retried)."""
    if isinstance(exc, JobError) or innermost_bundle_frame(exc, root) is None:
        return None
    return user_error(exc, root, "during training")


def _blaming(epoch_data: Callable[[int, int], Any], root: Path) -> Callable[[int, int], Any]:
    def wrapped(epoch: int, skip: int) -> Any:
        with blame_user(root, f"building epoch {epoch}'s data"):
            return epoch_data(epoch, skip)

    return wrapped


def _dataset_epochs(
    train: tf.data.Dataset, per_epoch: int, fixed: bool
) -> Callable[[int, int], Any]:
    def epoch_data(epoch: int, skip: int) -> Any:
        # Each fit() iterates the pipeline afresh, as Keras does per epoch; with a fixed
        # steps_per_epoch the pipeline is repeated and cut to it.
        ds = train.repeat().take(per_epoch) if fixed else train
        return ds.skip(skip) if skip else ds

    return epoch_data


def _dataset_resume_note(epoch: int, skip: int) -> str:
    return (
        f"resumed at epoch {epoch} after {skip} of its batches: the tf.data pipeline was "
        f"started afresh and its first {skip} batches skipped. This is exact when the "
        "pipeline's order is the same on every pass (no shuffle, or a shuffle with a fixed "
        "seed and reshuffle_each_iteration=False); a pipeline that reshuffles each pass "
        "resumes on a fresh order, so its remaining batches differ from the uninterrupted "
        "run's."
    )


def _array_epochs(
    feed: EpochFeed, n: int, batch: int, fixed: int | None, seed: int
) -> Callable[[int, int], Any]:
    feeds: list[EpochFeed] = []

    def epoch_data(epoch: int, skip: int) -> Any:
        order = data_mod.epoch_indices(n, batch, fixed, seed, epoch)
        if not feeds:
            feeds.append(EpochFeed(feed.x, feed.y, batch, len(order)))
        return feeds[0].epoch(order, skip)

    return epoch_data


def _save(built: Built, job_dir: Path, ctx: RunContext) -> list[str]:
    """The weights always (they load into the model the bundle builds); the .keras file
    when Keras can serialize the model (it needs the bundle's custom objects to load).
    Returns the names of the files written."""
    model = built.model
    partial = job_dir / "model.partial.weights.h5"
    model.save_weights(partial)
    os.replace(partial, job_dir / "model.weights.h5")
    try:
        save_keras(model, job_dir / "model.keras")
    except Exception as exc:
        (job_dir / "model.partial.keras").unlink(missing_ok=True)
        ctx.emit(
            {
                "type": "note",
                "message": f"model.keras could not be written ({type(exc).__name__}: {exc}); "
                "model.weights.h5 holds the trained weights: load them into the model your "
                "function builds (model.load_weights).",
            }
        )
        return ["model.weights.h5"]
    ctx.emit(
        {
            "type": "note",
            "message": "saved model.keras and model.weights.h5. model.keras uses the bundle's "
            "custom layers: to load it, put the bundle on sys.path and import its modules "
            "first (or pass custom_objects to keras.saving.load_model); model.weights.h5 "
            "loads into the model your function builds (model.load_weights).",
        }
    )
    return ["model.weights.h5", "model.keras"]
