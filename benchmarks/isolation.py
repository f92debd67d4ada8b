"""What isolating training children costs, measured on this machine, isolated (bubblewrap)
against plain (``HALFWAY_CODE_ISOLATION=none``) side by side in one run: the rounds
interleave (and alternate which goes first), so machine noise hits both alike. Each figure is
a median with its range, and the ratio isolated / plain.

- the sandbox alone: ``python -c pass`` under ``sandbox.command`` (the job's walls, mounts
  and allow-listed environment) against the same interpreter and environment without bwrap;
- a job's start: from ``LocalLauncher.start`` (staging included) to the child's ``started``
  message (TensorFlow imported, data built, model compiled), to its first ``steps`` message
  and to ``done``, with the real trainer (``workers.child.run``) on examples/classic.json
  shrunk to one epoch of 2,048 samples; checkpoints are committed as the supervisor does;
- a checkpoint's cost on a ``file://`` store, for the example model's real checkpoint and a
  100 MB one. "In place" is what the child paid before isolation: it wrote the file straight
  into the store's folder, then hashed it and wrote the commit marker. "Isolated" is what the
  supervisor pays now: ``JobFiles.commit_checkpoint`` reads the file from the child's scratch
  folder, copies it into the store (fsync), hashes it and writes the marker. The child's own
  write of the file (the same in both) is not timed.

    .venv/bin/python benchmarks/isolation.py [--rounds 5]

Needs bwrap and user namespaces (it fails at once without them). The cheap measurements (the
bare sandbox, the example checkpoint) take four times as many rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results
from machine import cpu_model
from storage_and_launch import example_checkpoint, example_spec

from service.files.storage import FileStore, StorageConfig
from workers import checkpoints, child, sandbox
from workers.launchers import LocalLauncher
from workers.staging import JobFiles

Timings = dict[str, list[float]]
ISOLATED, PLAIN = "isolated", "plain"


def fmt(values: list[float]) -> str:
    return f"median {statistics.median(values):8.4f} s [{min(values):.4f}..{max(values):.4f}]"


def compare(label: str, isolated: list[float], plain: list[float], baseline: str = PLAIN) -> None:
    mi, mp = statistics.median(isolated), statistics.median(plain)
    print(f"{label}")
    print(f"  {baseline + ':':9} {fmt(plain)}")
    print(f"  {ISOLATED + ':':9} {fmt(isolated)}")
    print(f"  isolation adds {mi - mp:+.4f} s (medians), ratio isolated/plain {mi / mp:.2f}x")
    # Rounds interleave, so each round's pair met the same load: their ratios, paired.
    paired = [i / p for i, p in zip(isolated, plain, strict=True)]
    print(
        f"  ratio paired by round: median {statistics.median(paired):.2f}x "
        f"[{min(paired):.2f}..{max(paired):.2f}]"
    )


def interleaved(rounds: int, runs: dict[str, Callable[[int], float]]) -> Timings:
    """``rounds`` timings of each run, alternating which goes first each round."""
    names = list(runs)
    out: Timings = {n: [] for n in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            out[name].append(runs[name](i))
    return out


def header() -> None:
    cpu = cpu_model()
    bwrap = shutil.which("bwrap")
    version = (
        subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
        if bwrap
        else "bwrap not installed"
    )
    print(f"date:   {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    print(f"cpu:    {cpu} ({os.cpu_count()} logical CPUs)")
    print(f"system: {platform.platform()}; Python {platform.python_version()}; {version}")
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load:   {' '.join(load)} (1, 5, 15 min) at the start: other work shares these CPUs")
    print()


# ------------------------------------------------------------------------------------------
# The sandbox alone


def bench_bare(rounds: int, tmp: Path) -> None:
    scratch = tmp / "bare"
    scratch.mkdir()
    argv = [sys.executable, "-c", "pass"]
    env = sandbox.child_env(os.environ, home=scratch, gpu_ids=[])
    mounts = sandbox.Mounts(scratch, (), sandbox.code_roots())
    walled = sandbox.command(argv, mounts)

    def run(command: list[str]) -> Callable[[int], float]:
        def once(_: int) -> float:
            started = time.perf_counter()
            subprocess.run(command, env=env, cwd=scratch, check=True)
            return time.perf_counter() - started

        return once

    run(walled)(0), run(argv)(0)  # warm the page cache for both
    times = interleaved(rounds, {ISOLATED: run(walled), PLAIN: run(argv)})
    compare("the sandbox alone: python -c pass", times[ISOLATED], times[PLAIN])


# ------------------------------------------------------------------------------------------
# A job's start


MARKS = ("started", "first steps", "done")


def bench_start(rounds: int, tmp: Path) -> None:
    spec = example_spec(tmp)
    spec["training"]["epochs"] = 1
    spec["data"]["samples"] = 2048
    spec["outputs"]["save_model"] = False
    launchers = {
        ISOLATED: LocalLauncher(sandbox.resolve("bubblewrap")),
        PLAIN: LocalLauncher(sandbox.resolve("none")),
    }
    storage = StorageConfig(
        url=None,
        artifact_dir=str(tmp / "artifacts"),
        data_dir=str(tmp / "data"),
        code_dir=str(tmp / "code"),
    ).to_dict()
    job_ids = iter(range(1000, 10**6))
    marks: dict[str, Timings] = {n: {m: [] for m in MARKS} for n in launchers}

    def one_job(name: str) -> dict[str, float]:
        payload = {
            "job_id": next(job_ids),
            "attempt": 1,
            "spec": spec,
            "storage": storage,
            "scratch_dir": str(tmp / "scratch"),
            "code_dir": str(tmp / "code"),
            "isolation": launchers[name].isolation.mode,
            "gpu_ids": [],
            "flush_seconds": 0.1,
            "resume_step": None,
            "max_parameters": None,
        }
        started = time.perf_counter()
        handle = launchers[name].start(child.run, payload, name="bench", gpus=0)
        seen: dict[str, float] = {}
        status, error = None, None
        try:
            while not handle.finished():
                for msg in handle.poll(0.05):
                    now = time.perf_counter() - started
                    if msg["type"] == "started":
                        seen.setdefault("started", now)
                    elif msg["type"] == "steps":
                        seen.setdefault("first steps", now)
                    elif msg["type"] == "checkpoint":
                        handle.commit_checkpoint(msg["step"])  # as the supervisor does
                    elif msg["type"] == "done":
                        seen["done"] = now
                        status, error = msg["status"], msg.get("error")
        finally:
            handle.close()
        if status != "succeeded" or set(seen) != set(MARKS):
            raise RuntimeError(f"{name} job ended {status} ({error}); seen {sorted(seen)}")
        return seen

    def run(name: str) -> Callable[[int], float]:
        def once(_: int) -> float:
            seen = one_job(name)
            for mark in MARKS:
                marks[name][mark].append(seen[mark])
            return seen["done"]

        return once

    one_job(ISOLATED), one_job(PLAIN)  # warm-up, not counted
    interleaved(rounds, {n: run(n) for n in launchers})
    for mark in MARKS:
        label = f"a job's start: launcher.start to {mark!r}"
        if mark == "done":
            label = "a whole job (1 epoch, 64 steps): launcher.start to 'done'"
        compare(label, marks[ISOLATED][mark], marks[PLAIN][mark])


# ------------------------------------------------------------------------------------------
# A checkpoint's cost


def write_as_child(source: Path, target: Path) -> None:
    """The child's own write of the checkpoint (as Checkpointer.save: data, then fsync)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(target, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
        out.flush()
        os.fsync(out.fileno())


def bench_checkpoint(name: str, source: Path, rounds: int, tmp: Path) -> None:
    store = FileStore(tmp / f"store-{name}")
    prefix = "7"

    def in_place(i: int) -> float:
        step = 100 + i
        target = store.path(checkpoints.data_key(prefix, step))
        write_as_child(source, target)
        started = time.perf_counter()
        # What checkpoints.commit did when the child had written into the store itself.
        marker = {
            "step": step,
            "bytes": target.stat().st_size,
            "sha256": checkpoints.sha256(target),
        }
        store.put_bytes(checkpoints.marker_key(prefix, step), json.dumps(marker).encode())
        took = time.perf_counter() - started
        checkpoints.remove_all(store, prefix)
        return took

    def isolated(i: int) -> float:
        step = 100 + i
        scratch = tmp / f"scratch-{name}"
        scratch.mkdir(exist_ok=True)
        files = JobFiles(store, prefix, scratch)
        write_as_child(source, checkpoints.checkpoint_path(scratch, step))
        started = time.perf_counter()
        files.commit_checkpoint(step)
        took = time.perf_counter() - started
        assert checkpoints.committed_steps(store, prefix) == [step]
        checkpoints.remove_all(store, prefix)
        return took

    in_place(0), isolated(0)  # warm-up, not counted
    times = interleaved(rounds, {ISOLATED: isolated, PLAIN: in_place})  # PLAIN: in place
    size = source.stat().st_size / 1024**2
    label = f"a checkpoint's commit, {name} ({size:.2f} MiB), file:// store"
    compare(label, times[ISOLATED], times[PLAIN], baseline="in place")


def bench_checkpoints(rounds: int, tmp: Path) -> None:
    example = example_checkpoint(tmp)  # imports TensorFlow: after the launches
    big = tmp / "big.npz"
    big.write_bytes(os.urandom(100 * 1024**2))
    bench_checkpoint("example model", example, 4 * rounds, tmp)
    bench_checkpoint("100 MB", big, rounds, tmp)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["bare", "start", "checkpoints"], default=None)
    args = parser.parse_args()
    rounds: int = args.rounds
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    header()
    with tempfile.TemporaryDirectory(prefix="halfway-isolation-") as tmp_name:
        tmp = Path(tmp_name)
        print(f"folders: {tmp} (store, scratch and data on the same file system)")
        print(f"rounds:  {rounds} per side (x4 for the bare sandbox and the example checkpoint)")
        print()
        if args.only in (None, "bare"):
            bench_bare(4 * rounds, tmp)
        if args.only in (None, "start"):
            bench_start(rounds, tmp)
        if args.only in (None, "checkpoints"):
            bench_checkpoints(rounds, tmp)


if __name__ == "__main__":
    results.run(main)
