"""What oneDNN does to float16 training on this CPU: the example's MLP and a small CNN trained
by ``workers.training.train`` in a fresh process for each run (TensorFlow reads
TF_ENABLE_ONEDNN_OPTS once, when it loads), under float32, mixed_bfloat16 and mixed_float16,
each with oneDNN on and off, rounds interleaved.

Each run trains three epochs of 80 steps (batch 32); the first epoch is the warm-up (tracing,
the first steps), and the figure is a step's time over the two after it: from the end of the
first epoch to the end of the third, as the epochs' metrics reached the host. The printout
gives, per model, each setting's time per step, and the ratios that decide
``workers.cpu.tensorflow_env``: float16 with oneDNN against float16 without, float16 without
oneDNN against float32 with it, and what turning oneDNN off costs float32 and bfloat16.

    .venv/bin/python benchmarks/float16_cpu.py [--rounds 3] [--publish]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import results
from machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
MODELS = {
    "mlp": {"kind": "mlp", "input_size": 784, "hidden": [128], "num_classes": 10},
    "cnn": {"kind": "cnn", "input_shape": [28, 28, 1], "filters": [8, 16], "num_classes": 10},
}
STEPS_PER_EPOCH = 80

# One run, in the child: train() on synthetic data; print when each epoch's metrics arrived.
CHILD = """
import json, sys, tempfile, threading, time
from pathlib import Path
from service.settings import Settings
from service.specs.normalization import normalize
from service.specs.schemas import JobSpec
from workers.context import RunContext
from workers.training import train
body = json.loads(sys.argv[1])
ended = []
def emit(message):
    if message["type"] == "metrics" and message["epoch"] >= 0:
        ended.append(time.perf_counter())
with tempfile.TemporaryDirectory() as home:
    spec = normalize(JobSpec.model_validate(body), Settings(home=Path(home)))
    ctx = RunContext(job_id=1, spec=spec.spec.model_dump(mode="json"), job_dir=Path(home) / "j",
                     data_dir=Path(home), emit=emit, stop=threading.Event())
    status = train(ctx)
print(json.dumps({"status": status, "ended": ended}))
"""


def job(model: str, policy: str) -> dict[str, object]:
    return {
        "precision": {"policy": policy},
        "model": MODELS[model],
        "data": {
            "kind": "synthetic",
            "samples": 32 * STEPS_PER_EPOCH,
            "features": 784,
            "classes": 10,
        },
        "optimizer": {"name": "adam", "learning_rate": 0.001},
        "training": {"epochs": 3, "batch_size": 32},
        "gradients": {"every": 0, "shadow_every": 0},
        "outputs": {"save_model": False},
    }


def one(model: str, policy: str, onednn: bool) -> float:
    """Seconds a step took in the second and third epochs, in a new process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="1" if onednn else "0")
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(job(model, policy))],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({model}, {policy}, oneDNN {onednn}):\n{proc.stderr}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ended = out["ended"]
    if out["status"] != "succeeded" or len(ended) != 3:
        raise SystemExit(f"the run ended {out['status']} after {len(ended)} epochs")
    return float(ended[2] - ended[0]) / (2 * STEPS_PER_EPOCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="mlp,cnn", help="of: " + ", ".join(MODELS))
    args = parser.parse_args()
    models = args.models.split(",")
    print(f"{cpu_model()}; load average before: {os.getloadavg()[0]:.2f}")
    settings = [(p, on) for p in POLICIES for on in (True, False)]
    times: dict[tuple[str, str, bool], list[float]] = {}
    for i in range(args.rounds):
        for model in models:
            for policy, on in settings if i % 2 == 0 else list(reversed(settings)):
                times.setdefault((model, policy, on), []).append(one(model, policy, on))
    med = {key: statistics.median(values) for key, values in times.items()}
    print(f"median ms per step over {args.rounds} rounds (2 epochs of {STEPS_PER_EPOCH} steps)")
    print(f"{'model':<5} {'policy':<15} {'oneDNN on':>10} {'oneDNN off':>11}")
    for model in models:
        for policy in POLICIES:
            with_, without = med[(model, policy, True)], med[(model, policy, False)]
            print(f"{model:<5} {policy:<15} {with_ * 1e3:>10.2f} {without * 1e3:>11.2f}")
    for model in models:
        f16_on, f16_off = med[(model, "mixed_float16", True)], med[(model, "mixed_float16", False)]
        f32_on, f32_off = med[(model, "float32", True)], med[(model, "float32", False)]
        bf_on, bf_off = med[(model, "mixed_bfloat16", True)], med[(model, "mixed_bfloat16", False)]
        print(
            f"{model}: float16 with oneDNN / without {f16_on / f16_off:.1f}x; "
            f"float16 without oneDNN / float32 with {f16_off / f32_on:.2f}x; "
            f"oneDNN off costs float32 {f32_off / f32_on:.2f}x, bfloat16 {bf_off / bf_on:.2f}x"
        )


if __name__ == "__main__":
    results.run(main)
