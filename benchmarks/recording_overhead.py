"""What recording every step costs: Halfway's training path against bare Keras.

The example model (784 -> 128 relu -> 10 softmax, batch 128, mixed_float16, Adam, synthetic
data), four ways, in one process:

  halfway@S    HalfwayTrainer + HalfwayLossScaleOptimizer + StepRecorder, fit once per epoch
               with StepStream draining, guarding and sending records once per execution
               (train()'s own objects, from workers.trainer.build_trainer)
  keras@S      the same model under stock Keras: compile() wraps Adam in its own
               LossScaleOptimizer; same data pipeline, same per-epoch fit loop, no recording
  halfway      Halfway's defaults: its default steps_per_execution and the spec's default
               checkpoint_every, i.e. everything train() does per step
  keras        what the Keras guides show: model.fit(x, y, batch_size=128, epochs=E) with
               steps_per_execution=1
  keras@S'     a second keras@S, run alongside as a control: keras@S' / keras@S would be 1
               on a quiet machine, so its spread is the noise floor of ratio (a)

S is Halfway's default steps_per_execution unless --spe says otherwise.

Ratios are of seconds per step: (a) halfway@S / keras@S (keras@S being the mean of the two
identical stock runs, keras@S and keras@S'), target <= 1.03 (recording is close to free);
(b) halfway / keras, target <= 0.75 (Halfway's defaults beat Keras').

The machine is noisy (2 cores, other work), so every path is traced and warmed up before
timing, and the paths run interleaved: in each round, halfway@S, keras@S and keras@S' take
turns epoch by epoch, then halfway and keras run --default-epochs epochs each, back to back
(keras in one fit() call, as its users write it, so its per-call setup weighs little; Halfway's
train() calls fit() once per epoch and pays for that), the order changing every round. Each
ratio is taken within a round (so under the same load) and the report gives its median over
rounds with the interquartile range and min..max. The ratio of process CPU time is printed
next to it: it is less sensitive to other processes' load.
``--profile`` (automatic when a target is missed) then times the graph alone, with and
without the in-graph record, against stock Keras' step. Run:

    .venv/bin/python benchmarks/recording_overhead.py [--rounds 12] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The example computes in float16: its environment is the one the launcher gives such a
# training child (oneDNN off on a CPU whose oneDNN float16 kernels are slow; workers/cpu.py).
from workers.cpu import CpuPrecision, tensorflow_env

os.environ.update(tensorflow_env("mixed_float16", CpuPrecision.detect(), os.environ))

import keras
import numpy as np
import results
import tensorflow as tf

from service.settings import Settings
from service.specs.normalization import normalize
from service.specs.schemas import JobSpec
from workers import data as data_mod
from workers.builders import build_model
from workers.checkpointer import Checkpointer
from workers.context import RunContext
from workers.feed import EpochFeed, epoch_dataset
from workers.guards import Guards
from workers.protocol import Message
from workers.recording import StepRecorder
from workers.stream import StepStream
from workers.trainer import DEFAULT_STEPS_PER_EXECUTION, Built, build_trainer

BATCH = 128
TARGET_SAME_SPE = 1.03
TARGET_DEFAULTS = 0.75


def example_spec(samples: int, home: Path, **training: Any) -> dict[str, Any]:
    body = {
        "precision": {"policy": "mixed_float16"},
        "loss_scale": {"mode": "dynamic"},
        "model": {"kind": "mlp", "input_size": 784, "hidden": [128], "num_classes": 10},
        "data": {"kind": "synthetic", "samples": samples, "features": 784, "classes": 10},
        "optimizer": {"name": "adam", "learning_rate": 0.001},
        "training": {"batch_size": BATCH, **training},
        "outputs": {"save_model": False},
    }
    spec: dict[str, Any] = normalize(
        JobSpec.model_validate(body), Settings(home=home)
    ).spec.model_dump(mode="json")
    return spec


@dataclass
class Data:
    x: np.ndarray
    y: np.ndarray
    x_all: Any
    y_all: Any
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return data_mod.steps_per_epoch(len(self.x), BATCH, None)

    feed: EpochFeed | None = None

    @classmethod
    def of(cls, spec: dict[str, Any], home: Path) -> Data:
        """The spec's training data, loaded as train() loads it, and held as constants."""
        arrays = data_mod.load_arrays(spec["data"], spec["training"], home)
        x, y = arrays.x_train, arrays.y_train
        return cls(x, y, tf.constant(x), tf.constant(y), spec["training"]["seed"])

    def epoch(self, epoch: int) -> Any:
        """That epoch's batches from one pipeline built once, as train() feeds them."""
        order = data_mod.epoch_indices(len(self.x), BATCH, None, self.seed, epoch)
        self.feed = self.feed or EpochFeed(self.x_all, self.y_all, BATCH, len(order))
        return self.feed.epoch(order)


@dataclass
class Timed:
    """One way of training. ``run`` trains whole epochs and adds the wall-clock and process
    CPU seconds they took to the current round's totals."""

    name: str
    run_epochs: Callable[[int, int], None]
    steps_per_round: int = 0
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def new_round(self) -> None:
        self.wall.append(0.0)
        self.cpu.append(0.0)

    def run(self, first_epoch: int, epochs: int) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.run_epochs(first_epoch, epochs)
        self.wall[-1] += time.perf_counter() - wall
        self.cpu[-1] += time.process_time() - cpu


class TimedStream(StepStream):
    """StepStream, timing its own per-execution work (drain, guards, batching, sending)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.host_seconds = 0.0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        start = time.perf_counter()
        super().on_train_batch_end(batch, logs)
        self.host_seconds += time.perf_counter() - start


S = TypeVar("S", bound=TimedStream)


def example_spe(spec: dict[str, Any], data: Data) -> int:
    """The steps per execution train() picks for the spec and data."""
    return int(
        spec["training"]["steps_per_execution"]
        or min(DEFAULT_STEPS_PER_EXECUTION, data.steps_per_epoch)
    )


def stream_for(
    spec: dict[str, Any],
    job_dir: Path,
    built: Built,
    emit: Callable[[Message], None],
    stream_class: type[S],
) -> S:
    """train()'s step stream for ``built``: checkpoints in ``job_dir``, messages to ``emit``."""
    ctx = RunContext(
        job_id=0, spec=spec, job_dir=job_dir, data_dir=job_dir, emit=emit, stop=threading.Event()
    )
    job_dir.mkdir(parents=True, exist_ok=True)
    return stream_class(
        ctx,
        built.recorder,
        Guards(spec["guards"], spec["loss_scale"]["min_scale"]),
        Checkpointer(job_dir),
        spec["training"]["checkpoint_every"],
        BATCH,
    )


@dataclass
class HalfwayPath:
    spec: dict[str, Any]
    data: Data
    job_dir: Path
    recorded: int = 0
    trained: int = 0

    def __post_init__(self) -> None:
        self.spe = example_spe(self.spec, self.data)
        self.built = build_trainer(self.spec, (784,), 10, self.spe)
        self.stream = stream_for(self.spec, self.job_dir, self.built, self.receive, TimedStream)

    def receive(self, message: Message) -> None:
        if message["type"] == "steps":
            self.recorded += len(message["records"])

    def run_epochs(self, first: int, epochs: int) -> None:
        fit_epochs(self.built.trainer, self.data, self.stream, first, epochs)
        self.trained += epochs * self.data.steps_per_epoch


def fit_epochs(
    trainer: keras.Model, data: Data, stream: StepStream, first: int, epochs: int
) -> None:
    """As train() does: one fit per epoch, on that epoch's batch order."""
    for epoch in range(first, first + epochs):
        trainer.fit(
            data.epoch(epoch),
            epochs=epoch + 1,
            initial_epoch=epoch,
            verbose=0,
            shuffle=False,
            callbacks=[stream],
        )


def keras_model(spec: dict[str, Any], spe: int) -> keras.Model:
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = build_model(spec, (784,), 10)
    finally:
        keras.config.set_dtype_policy("float32")
    model.compile(
        optimizer=keras.optimizers.Adam(0.001),
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        steps_per_execution=spe,
    )
    if not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        raise RuntimeError("stock Keras did not turn on its loss scaling")
    return model


def keras_same_loop(model: keras.Model, data: Data) -> Callable[[int, int], None]:
    def run_epochs(first: int, epochs: int) -> None:
        for epoch in range(first, first + epochs):
            model.fit(
                data.epoch(epoch), epochs=epoch + 1, initial_epoch=epoch, verbose=0, shuffle=False
            )

    return run_epochs


def keras_default_loop(model: keras.Model, data: Data) -> Callable[[int, int], None]:
    def run_epochs(first: int, epochs: int) -> None:
        model.fit(data.x, data.y, batch_size=BATCH, epochs=epochs, verbose=0)

    return run_epochs


def spread(values: list[float], digits: int = 3) -> str:
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return (
        f"{median:.{digits}f} [{q1:.{digits}f}..{q3:.{digits}f}] "
        f"({min(values):.{digits}f}..{max(values):.{digits}f})"
    )


class Unrecorded(StepRecorder):
    """A recorder whose in-graph write is a no-op: the train step without recording."""

    def record(self, loss: Any, scale: Any, finite: Any) -> None:
        pass


def profile(spec: dict[str, Any], data: Data, spe: int, rounds: int) -> None:
    """Per-step cost inside the graph alone (train_function called directly: no fit loop, no
    callbacks), so the host side and the step itself can be told apart."""
    recorded = build_trainer(spec, (784,), 10, spe)
    unrecorded = build_trainer(spec, (784,), 10, spe)
    unrecorded.trainer.recorder = Unrecorded(spe)  # before the step is traced
    # Its step count never moves, so a gradient meter would sample every step as step 0.
    unrecorded.trainer.meter = None
    variants: list[tuple[str, keras.Model, StepRecorder | None]] = [
        ("halfway step, recording", recorded.trainer, recorded.recorder),
        ("halfway step, no recording, no meter", unrecorded.trainer, None),
        ("stock keras step + LSO", keras_model(spec, spe), None),
    ]
    ordered = np.concatenate(
        [data_mod.epoch_indices(len(data.x), BATCH, None, data.seed, e) for e in range(4)]
    )
    iterators = []
    for _, model, recorder in variants:
        model.make_train_function()
        iterator = iter(epoch_dataset(data.x_all, data.y_all, ordered, BATCH, 0).repeat())
        for _ in range(3):
            model.train_function(iterator)
            if recorder is not None:
                recorder.drain()
        iterators.append(iterator)
    executions = max(1, 512 // spe)
    seconds: list[list[float]] = [[] for _ in variants]
    for r in range(rounds):
        for i in [(r + k) % len(variants) for k in range(len(variants))]:
            _, model, recorder = variants[i]
            start = time.perf_counter()
            for _ in range(executions):
                model.train_function(iterators[i])
                if recorder is not None:
                    recorder.drain()
            seconds[i].append((time.perf_counter() - start) / (executions * spe) * 1e6)
    print(f"\nprofile: the graph alone, microseconds per step at S={spe}, {rounds} rounds")
    base = seconds[2]
    for (name, _, _), values in zip(variants, seconds, strict=True):
        ratio = [a / b for a, b in zip(values, base, strict=True)]
        print(f"  {name:<28}{spread(values, 0):>34}   x stock {spread(ratio)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=4, help="per round, for ratio (a)")
    parser.add_argument("--default-epochs", type=int, default=16, help="per round, for ratio (b)")
    parser.add_argument("--samples", type=int, default=16384, help="128 steps per epoch")
    parser.add_argument("--spe", type=int, default=None, help="S for (a); Halfway's default")
    parser.add_argument(
        "--profile", action="store_true", help="also time the graph alone (always if missed)"
    )
    args = parser.parse_args()
    # Checkpoints and the spec's home go to a scratch directory, removed afterwards.
    with tempfile.TemporaryDirectory(prefix="halfway-bench-") as scratch:
        measure(args, Path(scratch))


def measure(args: argparse.Namespace, home: Path) -> None:
    defaults = example_spec(args.samples, home)
    data = Data.of(defaults, home)
    per_epoch = data.steps_per_epoch
    spe = args.spe or min(DEFAULT_STEPS_PER_EXECUTION, per_epoch)
    # (a) measures recording, not checkpoint writes; (b) is the whole default path.
    same = HalfwayPath(
        example_spec(args.samples, home, steps_per_execution=spe, checkpoint_every=10**9),
        data,
        home / "same",
    )
    full = HalfwayPath(defaults, data, home / "full")
    paths = [
        Timed(f"halfway@{spe}", same.run_epochs),
        Timed(f"keras@{spe}", keras_same_loop(keras_model(defaults, spe), data)),
        Timed("halfway", full.run_epochs),
        Timed("keras", keras_default_loop(keras_model(defaults, 1), data)),
        # A second, identical stock model: keras@S' / keras@S shows what noise alone does.
        Timed(f"keras@{spe}'", keras_same_loop(keras_model(defaults, spe), data)),
    ]
    for i, path in enumerate(paths):
        path.steps_per_round = per_epoch * (args.default_epochs if i in (2, 3) else args.epochs)
    print(
        f"{tf.__version__=} {keras.__version__=} cpus={os.cpu_count()} "
        f"gpus={len(tf.config.list_physical_devices('GPU'))} load={os.getloadavg()[0]:.1f}\n"
        f"{per_epoch} steps/epoch, {args.rounds} rounds of {args.epochs} epochs for (a) and "
        f"{args.default_epochs} for (b) per path; Halfway's defaults: steps_per_execution "
        f"{full.spe}, checkpoint_every {defaults['training']['checkpoint_every']}"
    )
    epoch = 0
    for path in paths:  # trace, compile and warm up outside the timing
        path.run_epochs(epoch, 2)
    epoch += 2
    same.stream.host_seconds = full.stream.host_seconds = 0.0
    for r in range(args.rounds):
        for path in paths:
            path.new_round()
        # (a) compares like with like, one epoch each in turn, so both see the same load.
        # (b) keeps Keras' default whole: one fit() for all of the round's epochs, as a
        # Keras user calls it (Halfway's train() calls fit() once per epoch, and pays for it).
        trio = [paths[0], paths[1], paths[4]]
        trio = trio[r % 3 :] + trio[: r % 3]
        default_pair = [paths[2], paths[3]] if r % 2 == 0 else [paths[3], paths[2]]
        for e in range(args.epochs):
            for path in trio:
                path.run(epoch + e, 1)
        for path in default_pair:
            path.run(epoch, args.default_epochs)
        epoch += max(args.epochs, args.default_epochs)
        print(
            f"round {r + 1:>2}: "
            + ", ".join(f"{p.name} {p.steps_per_round / p.wall[-1]:.0f}/s" for p in paths),
            flush=True,
        )

    for halfway in (same, full):
        halfway.stream.flush()
        if halfway.recorded != halfway.trained:
            raise RuntimeError(
                f"recorded {halfway.recorded} steps of {halfway.trained}: recording is broken"
            )

    def ratios(a: list[float], b: list[float]) -> list[float]:
        return [x / y for x, y in zip(a, b, strict=True)]

    print(f"\n{'path':<14}{'steps/s median [IQR] (min..max)':>44}{'CPU ms/step median':>22}")
    for p in paths:
        rates = [p.steps_per_round / s for s in p.wall]
        cpu = statistics.median(p.cpu) / p.steps_per_round * 1e3
        print(f"{p.name:<14}{spread(rates, 0):>44}{cpu:>22.3f}")
    print(
        f"\n{'ratio, seconds per step':<36}{'median [IQR] (min..max)':>40}{'target':>8}  met"
        f"{'CPU-time ratio':>16}"
    )
    # Both stock models at S are the same baseline: their mean is a steadier denominator.
    stock = Timed(
        f"keras@{spe}",
        paths[1].run_epochs,
        paths[1].steps_per_round,
        [(x + y) / 2 for x, y in zip(paths[1].wall, paths[4].wall, strict=True)],
        [(x + y) / 2 for x, y in zip(paths[1].cpu, paths[4].cpu, strict=True)],
    )
    missed = False
    for label, a, b, target in (
        (f"(a) halfway@{spe} / keras@{spe}", paths[0], stock, TARGET_SAME_SPE),
        ("(b) halfway default / keras default", paths[2], paths[3], TARGET_DEFAULTS),
    ):
        wall = ratios(a.wall, b.wall)
        met = statistics.median(wall) <= target
        missed = missed or not met
        cpu = statistics.median(ratios(a.cpu, b.cpu))
        print(
            f"{label:<36}{spread(wall):>40}{target:>8.2f}  {'yes' if met else 'NO ':<3}{cpu:>16.3f}"
        )
    control = ratios(paths[4].wall, paths[1].wall)
    control_cpu = statistics.median(ratios(paths[4].cpu, paths[1].cpu))
    label = f"control: keras@{spe}' / keras@{spe}"
    print(f"{label:<36}{spread(control):>40}{'-':>8}  {'':<3}{control_cpu:>16.3f}")
    print(
        "(the control runs two identical stock models side by side: its distance from 1 is "
        "what this machine's noise alone gives)"
    )
    host_share = [
        h.stream.host_seconds / sum(t.wall) for h, t in ((same, paths[0]), (full, paths[2]))
    ]
    print(
        f"\nhost side of recording (StepStream per execution: drain, guards, send) as a share "
        f"of the halfway paths' time: {host_share[0]:.2%} at S={spe}, {host_share[1]:.2%} default"
    )
    print(f"records checked: {same.recorded + full.recorded} steps, one record each")
    if missed:
        print("a target was missed: profiling the graph alone to see where the time goes")
    if missed or args.profile:
        profile(defaults, data, spe, max(6, args.rounds))


if __name__ == "__main__":
    results.run(main)
