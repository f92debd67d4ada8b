"""What a training child pays to start, before it reads its job: the imports it makes
(TensorFlow, Keras, ``workers.training``) and TensorFlow's first look for GPUs, in a fresh
Python process each time, as ``workers.child`` does them.

Two sets of packages side by side in one run, rounds interleaved (ABAB): the installed ones,
and the installed ones with the folders of ``--other`` in front (``pip install --target``), so
one package's version can be compared with everything else the same. Each round reports the
process's CPU time (user + system, from ``wait4``) and its wall time; the printout gives the
medians and their ratio (other / installed). ``--module`` times one import alone instead.

    .venv/bin/pip install --no-deps --target /tmp/mld-070 ml_dtypes==0.7.0
    .venv/bin/python benchmarks/child_start.py --other /tmp/mld-070 [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import results

ROOT = Path(__file__).resolve().parent.parent

CHILD_IMPORTS = (
    "import tensorflow as tf\n"
    "tf.config.list_physical_devices('GPU')\n"
    "import keras, ml_dtypes, workers.training\n"
    "print(ml_dtypes.__version__, tf.__version__, keras.__version__)\n"
)


def one(code: str, path: str | None) -> tuple[float, float, str]:
    """CPU seconds, wall seconds and the first line printed by ``code`` in a new process."""
    # From ROOT, `-c` finds Halfway's own packages; ``path`` goes in front of the installed ones.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=path or "")
    began = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the probe failed (PYTHONPATH={path}): {out}")
    return usage.ru_utime + usage.ru_stime, wall, out.strip().splitlines()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", required=True, help="folders to put first on PYTHONPATH")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--module", help="time `import MODULE` alone instead")
    args = parser.parse_args()
    code = CHILD_IMPORTS
    if args.module:
        code = f"import {args.module} as m\nprint(getattr(m, '__version__', '?'))\n"
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    one(code, None)  # a first run warms the page cache for both
    one(code, args.other)
    cpu: dict[str, list[float]] = {"installed": [], "other": []}
    wall: dict[str, list[float]] = {"installed": [], "other": []}
    versions: dict[str, str] = {}
    for i in range(args.rounds):
        order = ["installed", "other"] if i % 2 == 0 else ["other", "installed"]
        for name in order:
            c, w, versions[name] = one(code, args.other if name == "other" else None)
            cpu[name].append(c)
            wall[name].append(w)
    what = f"import {args.module}" if args.module else "a training child's imports"
    print(f"{what}, {args.rounds} rounds each, interleaved; medians")
    print(f"{'packages':<12} {'versions':<28} {'CPU s':>7} {'wall s':>7}")
    for name in ("installed", "other"):
        print(
            f"{name:<12} {versions[name]:<28} {statistics.median(cpu[name]):>7.2f} "
            f"{statistics.median(wall[name]):>7.2f}"
        )
    ratio_cpu = statistics.median(cpu["other"]) / statistics.median(cpu["installed"])
    ratio_wall = statistics.median(wall["other"]) / statistics.median(wall["installed"])
    print(f"other / installed: CPU {ratio_cpu:.2f}x, wall {ratio_wall:.2f}x")


if __name__ == "__main__":
    results.run(main)
