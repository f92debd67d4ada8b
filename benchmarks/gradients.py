"""What the gradient meter costs: a job's time with the meter at its defaults against off.

The example model (784 -> 128 relu -> 10 softmax, batch 128, mixed_float16, dynamic loss
scale, Adam, synthetic data; specs through JobSpec and normalize, as recording_overhead.py
builds them), on train()'s own path: build_trainer (which reads the spec's ``gradients``
section and creates the meter) and a per-epoch fit with the StepStream callback, which drains
the step records and the meter's samples once per execution and checks the alarms. Halfway's
default steps_per_execution; checkpoints off (they are the same with or without the meter,
and disk writes on a shared machine only add noise). Six paths, in one process:

  off         gradients every=0, shadow_every=0: no meter in the step at all
  off'        the same again, a control: off' / off would be 1 on a quiet machine, so its
              spread is the noise floor of the ratios
  defaults    the spec's defaults (gradients.every and shadow_every)
  never due   every = shadow_every = 10**9: a meter that no execution needs, so every
              execution runs the plain step: what the meter costs when it samples nothing
              (the host's choice of function per execution, the drain's count read)
  metered, nothing due
              the same meter, but every execution runs the metered step (as a job near its
              end does rather than trace the plain step, GradientMeter.metered): what the
              metered step's untaken branches cost a step
  stats@1     every=1, shadow_every=0: a statistics sample on every step
  shadow@1    every=0, shadow_every=1: a shadow sample (statistics and the float32 shadow
              forward/backward) on every step

With --samples 16000 an epoch is 125 steps and a round's --epochs 8 are 1000 steps, so each
round of ``defaults`` holds the samples of 1000 steps of a job at the defaults.

Everything is traced and warmed up before timing. The paths then run interleaved: in each
round off, off', defaults, never due and metered, nothing due train the round's epochs
taking turns epoch by epoch, the order changing every round; stats@1 and shadow@1 train one
epoch each (125 samples each) between off, off' and the others in one epoch slot, a
different one every round. Each ratio is of seconds per step within a round (so under the
same load) against the mean of off and off' (for stats@1 and shadow@1: their epochs in that
same slot), and the report gives its median over rounds with the interquartile range and
min..max, and the ratio of process CPU time beside it (less sensitive to other processes'
load). A sample's cost in plain steps is that ratio minus 1 (one sample per step). From the
parts, (a) is predicted as never due's ratio + (the unsampled steps of the executions that run
the metered step x its untaken branches' cost + statistics-only samples x their cost + shadow
samples x theirs) / steps, next to the measured one; the meter's host side (drain,
figures, alarms) is timed on its own.

Then whole jobs: workers.training.train() in this process with a RunContext (as
tests/training_runs.py runs it), the example with its default checkpoints, meter off and at
its defaults in ABBA order, --jobs pairs after an unmeasured warm-up job; building, tracing
(the meter's graph too) and checkpoints included, as a job pays them. Two lengths: a short
job (--job-epochs, 1000 steps, about 3 s here) and a long one (--long-job-epochs, 20,000
steps, about a minute here, still short for a GPU server). What a job pays once is then
measured on its own: a trainer's first two executions (the meter traces its metered step at
step 0 and the plain step at the next execution; off traces one; metered only traces the
metered step and runs it throughout) minus two at the steady pace, --traces trainers of each
kind, in turn; in plain steps and as the job length it alone is 3% of. The plain step's trace
(defaults minus metered only) over what a step pays in the metered step (metered, nothing
due against never due) is the job length below which running the metered step throughout
costs less: the break-even that workers.gradients.PLAIN_TRACE_STEPS stands for. Targets:

  (a)  defaults / off, seconds per step, <= 1.03 (the issue's "within 3% of a job's time")
  (a') defaults / off, the long job's seconds, <= 1.03; the short job's ratio is printed
       beside it without a target: the one-time cost weighs less the longer the job

Run:

    .venv/bin/python benchmarks/gradients.py [--rounds 7] [--jobs 2] [--long-job-epochs 160]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The example computes in float16: its environment is the one the launcher gives such a
# training child (oneDNN off on a CPU whose oneDNN float16 kernels are slow; workers/cpu.py).
from workers.cpu import CpuPrecision, tensorflow_env

os.environ.update(tensorflow_env("mixed_float16", CpuPrecision.detect(), os.environ))

import keras
import results
import tensorflow as tf
from machine import cpu_model
from recording_overhead import (
    BATCH,
    Data,
    Timed,
    TimedStream,
    example_spe,
    example_spec,
    fit_epochs,
    spread,
    stream_for,
)

from service.specs.schemas import GradientsSpec
from workers import data as data_mod
from workers.context import RunContext
from workers.feed import epoch_dataset
from workers.gradients import PLAIN_TRACE_STEPS
from workers.protocol import Message
from workers.trainer import DEFAULT_STEPS_PER_EXECUTION, build_trainer
from workers.training import train

TARGET_DEFAULTS = 1.03
NEVER = 10**9
OFF = {"every": 0, "shadow_every": 0}


class MeterStream(TimedStream):
    """TimedStream, also timing the meter's own host side (drain, figures, alarms)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter_seconds = 0.0

    def _gradients(self) -> None:
        start = time.perf_counter()
        super()._gradients()
        self.meter_seconds += time.perf_counter() - start


@dataclass
class Counts:
    """What a run sent: step records, gradient samples and, of those, shadow samples."""

    recorded: int = 0
    samples: int = 0
    shadows: int = 0

    def receive(self, message: Message) -> None:
        if message["type"] == "steps":
            self.recorded += len(message["records"])
        elif message["type"] == "gradients":
            self.samples += len(message["samples"])
            self.shadows += sum(1 for s in message["samples"] if s["shadow"])


@dataclass
class MeterPath:
    """One way of training: train()'s objects for a spec, fit once per epoch with the stream."""

    spec: dict[str, Any]
    data: Data
    job_dir: Path
    trained: int = 0

    def __post_init__(self) -> None:
        self.counts = Counts()
        self.spe = example_spe(self.spec, self.data)
        self.built = build_trainer(self.spec, (784,), 10, self.spe)
        self.stream = stream_for(
            self.spec, self.job_dir, self.built, self.counts.receive, MeterStream
        )

    def run_epochs(self, first: int, epochs: int) -> None:
        fit_epochs(self.built.trainer, self.data, self.stream, first, epochs)
        self.trained += epochs * self.data.steps_per_epoch

    def reset_counts(self) -> None:
        """After the warm-up: count only the timed rounds' samples and host time."""
        self.stream.flush()
        self.counts.samples = self.counts.shadows = 0
        self.stream.host_seconds = self.stream.meter_seconds = 0.0


def meter_spec(
    samples: int, home: Path, gradients: dict[str, Any] | None, **training: Any
) -> dict[str, Any]:
    """The example's normalized spec; ``gradients`` (validated by the API's own schema)
    replaces its section, None keeps the defaults the schema gives every job."""
    spec = example_spec(samples, home, **training)
    if gradients is not None:
        spec["gradients"] = GradientsSpec.model_validate(gradients).model_dump(mode="json")
    return spec


def machine() -> str:
    cpu = cpu_model()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return (
        f"cpu: {cpu}, {os.cpu_count()} logical CPUs ({len(os.sched_getaffinity(0))} usable); "
        f"load {load} (1, 5, 15 min) at the start: other work shares these CPUs\n"
        f"{tf.__version__=} {keras.__version__=} "
        f"gpus={len(tf.config.list_physical_devices('GPU'))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=8, help="per round, for (a)")
    parser.add_argument("--samples", type=int, default=16000, help="125 steps per epoch")
    parser.add_argument("--jobs", type=int, default=2, help="ABBA pairs of whole jobs (a')")
    parser.add_argument("--job-epochs", type=int, default=8, help="epochs of a short job")
    parser.add_argument(
        "--long-job-epochs", type=int, default=160, help="epochs of a long job (0: none)"
    )
    parser.add_argument(
        "--traces", type=int, default=4, help="trainers built for the one-time cost"
    )
    args = parser.parse_args()
    # The specs' home and the jobs' checkpoints go to a scratch directory, removed afterwards.
    with tempfile.TemporaryDirectory(prefix="halfway-bench-") as scratch:
        print(machine(), flush=True)
        missed, pace = steady(args, Path(scratch))
        lengths = [(args.job_epochs, None), (args.long_job_epochs, TARGET_DEFAULTS)]
        for epochs, target in lengths:
            if epochs > 0 and args.jobs > 0:
                missed = whole_jobs(args, Path(scratch), epochs, target) or missed
        missed = one_time_cost(args, Path(scratch), pace) or missed
    if missed:
        print("\nMISSED: a target was missed (see the rows marked MISSED above)")


def ratio_row(label: str, wall: list[float], cpu: list[float], target: float | None) -> bool:
    """Prints one ratio; True if it misses its target."""
    missed = target is not None and statistics.median(wall) > target
    verdict = "" if target is None else "MISSED" if missed else "yes"
    goal = "-" if target is None else f"{target:.2f}"
    print(f"{label:<36}{spread(wall):>40}{goal:>8}  {verdict:<6}{statistics.median(cpu):>13.3f}")
    return missed


def divide(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


@dataclass
class Pace:
    """From the steady rounds: a plain step's median seconds (wall, CPU), and what a step
    pays in the metered step when nothing is due, a fraction of a step (by CPU time)."""

    step: float
    step_cpu: float
    branches_cpu: float


def steady(args: argparse.Namespace, home: Path) -> tuple[bool, Pace]:
    """Seconds per step of the seven paths, interleaved: whether (a) misses its target, and
    the pace the one-time cost is read against."""
    defaults = meter_spec(args.samples, home, None, checkpoint_every=10**9)
    every, shadow_every = defaults["gradients"]["every"], defaults["gradients"]["shadow_every"]
    data = Data.of(defaults, home)
    per_epoch = data.steps_per_epoch
    configs: list[tuple[str, dict[str, Any] | None]] = [
        ("off", OFF),
        ("off'", OFF),
        (f"defaults {every}/{shadow_every}", None),
        ("never due", {"every": NEVER, "shadow_every": NEVER}),
        ("metered, nothing due", {"every": NEVER, "shadow_every": NEVER}),
        ("stats@1", {"every": 1, "shadow_every": 0}),
        ("shadow@1", {"every": 0, "shadow_every": 1}),
    ]
    warmup = 2
    meters: list[MeterPath] = []
    for i, (_, gradients) in enumerate(configs):
        spec = meter_spec(args.samples, home, gradients, checkpoint_every=10**9)
        path = MeterPath(spec, data, home / f"path{i}")
        if configs[i][0].startswith("metered"):
            assert path.built.trainer.meter is not None
            path.built.trainer.meter.ends_at = 0  # at its end throughout: always metered
        path.run_epochs(0, warmup)  # trace, compile and warm up outside the timing
        path.reset_counts()
        meters.append(path)
    off, _, dflt, _, _, stats1, shadow1 = meters
    if off.built.trainer.meter is not None or dflt.built.trainer.meter is None:
        raise RuntimeError("build_trainer did not read the spec's gradients section")
    paths = [Timed(name, p.run_epochs) for (name, _), p in zip(configs, meters, strict=True)]
    long_paths, short_paths = paths[:5], paths[5:]
    for p in long_paths:
        p.steps_per_round = per_epoch * args.epochs
    for p in short_paths:
        p.steps_per_round = per_epoch
    print(
        f"{per_epoch} steps/epoch, steps_per_execution {off.spe}; {args.rounds} rounds, each "
        f"of {args.epochs} epochs ({per_epoch * args.epochs} steps) for off, off', defaults, "
        f"never due and metered, nothing due and 1 epoch for stats@1 and shadow@1; the spec's "
        f"defaults: every={every}, shadow_every={shadow_every}",
        flush=True,
    )

    # stats@1 and shadow@1 are compared with off and off' in the same slot (the same epoch of
    # the round, seconds apart): seconds per step, wall and CPU, one value per round.
    slot_wall: list[float] = []
    slot_cpu: list[float] = []
    for r in range(args.rounds):
        for p in paths:
            p.new_round()
        order = long_paths[r % 5 :] + long_paths[: r % 5]
        short = short_paths if r % 2 == 0 else short_paths[::-1]
        first = warmup + r * args.epochs
        for e in range(args.epochs):
            if e != r % args.epochs:
                for p in order:
                    p.run(first + e, 1)
                continue
            wall = cpu = 0.0
            for p in order[:2] + short + order[2:]:
                before = p.wall[-1], p.cpu[-1]
                p.run(first + e, 1)
                if p in paths[:2]:
                    wall += (p.wall[-1] - before[0]) / per_epoch / 2
                    cpu += (p.cpu[-1] - before[1]) / per_epoch / 2
            slot_wall.append(wall)
            slot_cpu.append(cpu)
        print(
            f"round {r + 1:>2}: "
            + ", ".join(f"{p.name} {p.steps_per_round / p.wall[-1]:.0f}/s" for p in paths),
            flush=True,
        )

    for m in meters:
        m.stream.flush()
        if m.counts.recorded != m.trained:
            raise RuntimeError(f"recorded {m.counts.recorded} of {m.trained} steps: broken")
    timed_steps = args.rounds * per_epoch * args.epochs
    samples, shadows = dflt.counts.samples, dflt.counts.shadows
    timed = range(warmup * per_epoch, warmup * per_epoch + timed_steps)
    due = [t for t in timed if t % every == 0 or t % shadow_every == 0]
    if (samples, shadows) != (len(due), sum(1 for t in due if t % shadow_every == 0)):
        raise RuntimeError(f"defaults drained {samples} samples, {shadows} shadows: broken")
    for m, expected in ((stats1, 0), (shadow1, args.rounds * per_epoch)):
        if m.counts.samples != args.rounds * per_epoch or m.counts.shadows != expected:
            raise RuntimeError(f"{m.counts}: the meter is broken")

    def per_step(p: Timed, cpu: bool = False) -> list[float]:
        return [t / p.steps_per_round for t in (p.cpu if cpu else p.wall)]

    def base(p: Timed, cpu: bool = False) -> list[float]:
        if p in short_paths:
            return slot_cpu if cpu else slot_wall
        # Both meterless paths are the same baseline: their mean is a steadier denominator.
        pair = zip(per_step(paths[0], cpu), per_step(paths[1], cpu), strict=True)
        return [(x + y) / 2 for x, y in pair]

    def ratio(p: Timed, cpu: bool = False) -> list[float]:
        return divide(per_step(p, cpu), base(p, cpu))

    print(
        f"\n{'path':<20}{'steps/s median [IQR] (min..max)':>40}{'CPU ms/step':>13}"
        f"{'samples':>9}{'shadows':>9}"
    )
    for p, m in zip(paths, meters, strict=True):
        rates = [p.steps_per_round / s for s in p.wall]
        cpu = statistics.median(p.cpu) / p.steps_per_round * 1e3
        print(
            f"{p.name:<20}{spread(rates, 0):>40}{cpu:>13.3f}"
            f"{m.counts.samples:>9}{m.counts.shadows:>9}"
        )
    print("(samples, shadows: what each path's stream sent during the timed rounds)")

    header = f"\n{'seconds per step / off':<36}{'median [IQR] (min..max)':>40}{'target':>8}  met"
    print(f"{header}{'CPU-time ratio':>17}")
    a = ratio(paths[2])
    label = f"(a) defaults {every}/{shadow_every} / off"
    missed = ratio_row(label, a, ratio(paths[2], True), TARGET_DEFAULTS)
    fixed = ratio(paths[3])
    control_cpu = divide(per_step(paths[1], True), per_step(paths[0], True))
    ratio_row(
        "control: off' / off", divide(per_step(paths[1]), per_step(paths[0])), control_cpu, None
    )
    ratio_row("never due / off", fixed, ratio(paths[3], True), None)
    # What a step pays in the metered step when nothing is due: against never due, which
    # runs the plain step with the same meter (the same host side).
    branches = divide(per_step(paths[4]), per_step(paths[3]))
    branches_cpu = divide(per_step(paths[4], True), per_step(paths[3], True))
    ratio_row("metered, nothing due / never due", branches, branches_cpu, None)
    print(
        "(the control trains two identical meterless models side by side: its distance from 1 "
        "is what this machine's noise alone gives)"
    )

    print(
        f"\n{'one sample costs, in plain steps':<44}{'median [IQR] (min..max)':>40}"
        f"{'ms/sample':>11}{'by CPU s':>10}"
    )
    costs: list[list[float]] = []
    for label, p in (
        ("a statistics sample (stats@1)", paths[5]),
        ("a shadow sample (shadow@1: stats + f32)", paths[6]),
    ):
        steps = [x - 1 for x in ratio(p)]
        ms = [(t - b) * 1e3 for t, b in zip(per_step(p), base(p), strict=True)]
        by_cpu = statistics.median(ratio(p, True)) - 1
        print(f"{label:<44}{spread(steps, 2):>40}{statistics.median(ms):>11.2f}{by_cpu:>10.2f}")
        costs.append(steps)
    stat_steps, shadow_steps = costs
    shadow_only = [y - x for x, y in zip(stat_steps, shadow_steps, strict=True)]
    print(f"{'  of which the float32 shadow alone':<44}{spread(shadow_only, 2):>40}")
    print(
        f"(a plain step in those slots: {statistics.median(slot_wall) * 1e3:.2f} ms median; "
        "by CPU s: the same from CPU seconds)"
    )

    # (a) from its parts: never due's cost on every step; the metered step's untaken branches
    # on every other step of an execution that holds a sample (the host runs the metered step
    # for all of it); each sample at its price in plain steps.
    meter = dflt.built.trainer.meter
    assert meter is not None
    in_metered = 0
    for epoch in range(warmup, warmup + args.rounds * args.epochs):
        for start in range(0, per_epoch, dflt.spe):
            length = min(dflt.spe, per_epoch - start)
            if meter.due_within(epoch * per_epoch + start, length):
                in_metered += length
    stats_only = samples - shadows
    x, y, f = (statistics.median(v) for v in (stat_steps, shadow_steps, fixed))
    b = statistics.median(branches) - 1
    predicted = f + ((in_metered - samples) * b + stats_only * x + shadows * y) / timed_steps
    print(
        f"\n(a) from its parts: never due {f:.3f} + ({in_metered - samples} unsampled steps of "
        f"metered executions x {b:.3f} + {stats_only} statistics samples x {x:.2f} + {shadows} "
        f"shadow samples x {y:.2f} steps) / {timed_steps} steps = {predicted:.3f}; measured "
        f"{statistics.median(a):.3f}"
    )
    print("the meter's host side (drain, figures, alarms), as a share of each path's time:")
    for p, m in zip(paths[2:], meters[2:], strict=True):
        wall, meter_s = sum(p.wall), m.stream.meter_seconds
        each = f", {meter_s / m.counts.samples * 1e3:.3f} ms per sample" if m.counts.samples else ""
        print(
            f"  {p.name:<20} meter {meter_s / wall:6.2%}{each}; "
            f"whole StepStream {m.stream.host_seconds / wall:6.2%}"
        )
    pace = Pace(
        statistics.median(base(paths[0])),
        statistics.median(base(paths[0], True)),
        statistics.median(branches_cpu) - 1,
    )
    return missed, pace


def whole_jobs(args: argparse.Namespace, home: Path, epochs: int, target: float | None) -> bool:
    """Whole train() jobs of ``epochs``, meter off and at its defaults, ABBA; True if (a')
    misses ``target``."""
    names = ["off", "defaults"]
    specs = {
        "off": meter_spec(args.samples, home, OFF, epochs=epochs),
        "defaults": meter_spec(args.samples, home, None, epochs=epochs),
    }
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    runs: dict[str, list[Counts]] = {n: [] for n in names}
    # The first train() in a process pays for more than its own job: a warm-up job first.
    for i, name in enumerate(["off"] + [n for j in range(args.jobs) for n in _abba(names, j)]):
        counts = Counts()
        ctx = RunContext(
            job_id=i,
            spec=specs[name],
            job_dir=home / "jobs" / str(i),
            data_dir=home,
            emit=counts.receive,
            stop=threading.Event(),
        )
        start, start_cpu = time.perf_counter(), time.process_time()
        status = train(ctx)
        if status != "succeeded":
            raise RuntimeError(f"the {name} job ended {status}")
        if i > 0:
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            runs[name].append(counts)
    steps = runs["off"][0].recorded
    print(
        f"\nwhole jobs: train() of {epochs} epochs ({steps} steps, checkpoint_every "
        f"{specs['off']['training']['checkpoint_every']}), off and defaults in ABBA order, "
        f"{args.jobs} pairs after a warm-up job"
    )
    for name in names:
        c = runs[name][0]
        if any(r.recorded != steps for r in runs[name]) or (name != "off") != (c.shadows > 0):
            raise RuntimeError(f"{name}: {runs[name]}: the jobs did not run as specified")
        seconds = ", ".join(f"{w:.2f}" for w in wall[name])
        print(
            f"  {name:<10} seconds {seconds}; CPU s median {statistics.median(cpu[name]):.2f}; "
            f"{c.samples} samples, {c.shadows} shadows each"
        )
    header = f"{'whole job seconds':<36}{'median [IQR] (min..max)':>40}{'target':>8}  met"
    print(f"{header}{'CPU-time ratio':>17}")
    return ratio_row(
        f"(a') defaults / off, {steps} steps",
        divide(wall["defaults"], wall["off"]),
        divide(cpu["defaults"], cpu["off"]),
        target,
    )


def one_time_cost(args: argparse.Namespace, home: Path, pace: Pace) -> bool:
    """What a job pays once: its first two executions (each traces a step function: the
    metered one at step 0, then the plain one; off traces one; metered only, one) minus two
    executions at the kind's own steady pace, a trainer built afresh each time, the kinds in
    turn. Prints the job length that the meter's part alone is 3% of, and the plain step's
    trace against what the metered step costs a step; never misses a target itself."""
    names = ["off", "defaults", "metered only"]
    specs = {n: meter_spec(args.samples, home, OFF if n == "off" else None) for n in names}
    arrays = data_mod.load_arrays(specs["off"]["data"], specs["off"]["training"], home)
    x_all, y_all = tf.constant(arrays.x_train), tf.constant(arrays.y_train)
    order = data_mod.epoch_indices(len(arrays.x_train), BATCH, None, 0, 0)
    spe = min(DEFAULT_STEPS_PER_EXECUTION, len(order))
    once: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for j in range(args.traces):
        for name in names[j % 3 :] + names[: j % 3]:
            built = build_trainer(specs[name], (784,), 10, spe)
            meter = built.trainer.meter
            if meter is not None and name == "metered only":
                meter.ends_at = 0  # at its end throughout: never traces the plain step
            built.trainer.make_train_function()
            iterator = iter(epoch_dataset(x_all, y_all, order, BATCH, 0).repeat())
            took = []
            for _ in range(6):
                start, start_cpu = time.perf_counter(), time.process_time()
                built.trainer.train_function(iterator)
                took.append((time.perf_counter() - start, time.process_time() - start_cpu))
                if meter is not None:
                    meter.drain()  # as the stream does after each execution
            steady_pace = [statistics.median(t[k] for t in took[2:]) for k in (0, 1)]
            wall_once, cpu_once = (took[0][k] + took[1][k] - 2 * steady_pace[k] for k in (0, 1))
            once[name].append((wall_once, cpu_once))
    first = {
        n: [statistics.median(w for w, _ in once[n]), statistics.median(c for _, c in once[n])]
        for n in names
    }
    extra, extra_cpu = (first["defaults"][k] - first["off"][k] for k in (0, 1))
    print(
        f"\none-time cost, the first two executions minus two at the steady pace (median of "
        f"{args.traces}), wall s (CPU s): "
        + ", ".join(f"{n} {first[n][0]:.2f} ({first[n][1]:.2f})" for n in names)
    )
    print(
        f"  the meter's graphs add {extra:+.2f} s (CPU {extra_cpu:+.2f} s), "
        f"~{extra / pace.step:+.0f} plain steps; that alone is 3% of a job that trains "
        f"{extra / 0.03:.0f} s"
    )
    plain_cpu = first["defaults"][1] - first["metered only"][1]
    per_step = pace.branches_cpu * pace.step_cpu
    even = f"{plain_cpu / per_step:.0f} steps" if per_step > 0 else "never (no cost measured)"
    print(
        f"  the plain step's trace, defaults minus metered only: CPU {plain_cpu:.2f} s; the "
        f"metered step costs a step {pace.branches_cpu:+.1%} ({per_step * 1e3:.3f} ms CPU): "
        f"break-even at {even} (PLAIN_TRACE_STEPS = {PLAIN_TRACE_STEPS})"
    )
    return False


def _abba(names: list[str], pair: int) -> list[str]:
    return names if pair % 2 == 0 else names[::-1]


if __name__ == "__main__":
    results.run(main)
