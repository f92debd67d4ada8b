"""What a training child pays to start, before it reads its job: the imports it makes
(TensorFlow, Keras, ``workers.training``) and TensorFlow's first look for GPUs, in a fresh
Python process each time, as ``workers.child`` does them.

Two variants side by side in one run, rounds interleaved (ABAB). With ``--other``: the
installed packages, and the installed ones with the folders of ``--other`` in front (``pip
install --target``), so one package's version can be compared with everything else the same
(``--module`` times one import alone instead). With ``--extras``: the child's imports as it
makes them, Keras's optional pandas and matplotlib left out (``workers.child.KERAS_EXTRAS``),
against the same imports with them loaded, as a child did before (they are installed here by
the client extra). Each round reports the process's CPU time (user + system, from ``wait4``)
and its wall time; the printout gives the medians and their ratio (B / A).

    .venv/bin/pip install --no-deps --target /tmp/mld-070 ml_dtypes==0.7.0
    .venv/bin/python benchmarks/child_start.py --other /tmp/mld-070 [--rounds 7]
    .venv/bin/python benchmarks/child_start.py --extras [--rounds 7]
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


def child_imports(hidden: str) -> str:
    """The child's imports, with the names of the expression ``hidden`` kept from Keras."""
    return (
        "from workers.child import KERAS_EXTRAS, unused_by_keras\n"
        f"with unused_by_keras({hidden}):\n"
        "    import tensorflow as tf\n"
        "    tf.config.list_physical_devices('GPU')\n"
        "import keras, ml_dtypes, workers.training\n"
        "print(ml_dtypes.__version__, tf.__version__, keras.__version__)\n"
    )


CHILD_IMPORTS = child_imports("KERAS_EXTRAS")  # as workers.child makes them
WITH_EXTRAS = child_imports("()")  # nothing kept out: as a child made them before


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
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--other", help="folders to put first on PYTHONPATH")
    which.add_argument("--extras", action="store_true", help="without Keras's extras vs with")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--module", help="with --other: time `import MODULE` alone instead")
    args = parser.parse_args()
    code = CHILD_IMPORTS
    if args.module:
        code = f"import {args.module} as m\nprint(getattr(m, '__version__', '?'))\n"
    # Each variant: its name, the code it runs and the PYTHONPATH it runs it with.
    variants: list[tuple[str, str, str | None]] = (
        [("without extras", CHILD_IMPORTS, None), ("with extras", WITH_EXTRAS, None)]
        if args.extras
        else [("installed", code, None), ("other", code, args.other)]
    )
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for _, source, path in variants:
        one(source, path)  # a first run warms the page cache for each
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    wall: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    versions: dict[str, str] = {}
    for i in range(args.rounds):
        for name, source, path in variants if i % 2 == 0 else variants[::-1]:
            c, w, versions[name] = one(source, path)
            cpu[name].append(c)
            wall[name].append(w)
    what = f"import {args.module}" if args.module else "a training child's imports"
    print(f"{what}, {args.rounds} rounds each, interleaved; medians")
    print(f"{'variant':<15} {'versions':<28} {'CPU s':>7} {'wall s':>7}")
    for name, _, _ in variants:
        print(
            f"{name:<15} {versions[name]:<28} {statistics.median(cpu[name]):>7.2f} "
            f"{statistics.median(wall[name]):>7.2f}"
        )
    (a, _, _), (b, _, _) = variants
    ratio_cpu = statistics.median(cpu[b]) / statistics.median(cpu[a])
    ratio_wall = statistics.median(wall[b]) / statistics.median(wall[a])
    print(f"{b} / {a}: CPU {ratio_cpu:.2f}x, wall {ratio_wall:.2f}x")


if __name__ == "__main__":
    results.run(main)
