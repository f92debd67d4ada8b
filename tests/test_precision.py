"""What a job's precision settings do to the model: the per-layer report, and the grappler
graph rewrite (the TF 2 form of TF_ENABLE_AUTO_MIXED_PRECISION)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tensorflow as tf

from tests.training_runs import job_spec, run_job
from workers.builders import precision_report
from workers.cpu import CpuPrecision
from workers.devices import configure_graph_rewrite
from workers.trainer import build_trainer

pytestmark = pytest.mark.keras

ROOT = Path(__file__).resolve().parent.parent


def report(tmp_path: Path, **precision: Any) -> dict[str, dict[str, Any]]:
    built = build_trainer(job_spec(tmp_path, precision=precision), (8,), 3, 1)
    return {row["layer"]: row for row in precision_report(built.model)}


def test_report_shows_float16_dense_layers_and_the_float32_softmax(tmp_path: Path) -> None:
    rows = report(tmp_path, policy="mixed_float16")
    assert list(rows) == ["dense_0", "logits", "predictions"]
    for name in ("dense_0", "logits"):
        assert rows[name]["class"] == "Dense"
        assert rows[name]["variable_dtype"] == "float32"
        assert rows[name]["compute_dtype"] == "float16"
        assert rows[name]["output_dtype"] == "float16"
    assert rows["dense_0"]["parameters"] == 8 * 8 + 8
    softmax = rows["predictions"]
    assert softmax["class"] == "Activation"
    assert (softmax["policy"], softmax["compute_dtype"], softmax["output_dtype"]) == (
        "float32",
        "float32",
        "float32",
    )


def test_report_without_output_float32_shows_a_float16_softmax(tmp_path: Path) -> None:
    rows = report(tmp_path, policy="mixed_float16", output_float32=False)
    assert list(rows) == ["dense_0", "predictions"]
    assert rows["predictions"]["output_dtype"] == "float16"


def test_report_follows_a_dtype_pair_mapped_to_mixed_bfloat16(tmp_path: Path) -> None:
    rows = report(tmp_path, policy={"variable_dtype": "float32", "compute_dtype": "bfloat16"})
    assert rows["dense_0"]["policy"] == "mixed_bfloat16"
    assert rows["dense_0"]["variable_dtype"] == "float32"
    assert rows["dense_0"]["output_dtype"] == "bfloat16"
    assert rows["predictions"]["output_dtype"] == "float32"


def test_a_job_reports_its_layers_dtypes_when_it_starts(tmp_path: Path) -> None:
    run = run_job(job_spec(tmp_path, training={"epochs": 1}), tmp_path / "job")
    assert run.status == "succeeded", run.error
    rows = run.started["precision_report"]
    assert [(r["layer"], r["variable_dtype"], r["output_dtype"]) for r in rows] == [
        ("dense_0", "float32", "float16"),
        ("logits", "float32", "float16"),
        ("predictions", "float32", "float32"),
    ]


def test_graph_rewrite_off_leaves_grappler_alone() -> None:
    before = tf.config.optimizer.get_experimental_options()
    assert configure_graph_rewrite(False) is None
    assert tf.config.optimizer.get_experimental_options() == before


# The rewrite is a process-wide grappler option with no way back, so it runs in a process of
# its own, and the float32 run it is compared with runs there first.
REWRITE_SCRIPT = """
import json, sys, tempfile
from pathlib import Path
import tensorflow as tf
from tests.training_runs import job_spec, run_job
from workers.devices import configure_graph_rewrite

tmp = Path(sys.argv[1])
plain = run_job(job_spec(tmp, precision={"policy": "float32"}), tmp / "plain")
before = tf.config.optimizer.get_experimental_options()
option = configure_graph_rewrite(True)
after = tf.config.optimizer.get_experimental_options()
spec = job_spec(
    tmp,
    precision={"policy": "float32", "graph_rewrite": True},
    training={"jit_compile": True},
)
run = run_job(spec, tmp / "rewrite")
print(json.dumps({
    "option": option, "before": before, "after": after,
    "status": run.status, "error": run.error, "device": run.started["device"],
    "mode": spec["loss_scale"]["mode"],
    "plain": plain.records, "rewrite": run.records,
}))
"""


def test_graph_rewrite_sets_the_onednn_option_and_does_what_this_cpu_allows(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "-1"}
    done = subprocess.run(
        [sys.executable, "-c", REWRITE_SCRIPT, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    option = "auto_mixed_precision_onednn_bfloat16"  # the CPU form; a GPU gets auto_mixed_precision
    assert out["option"] == option
    assert option not in out["before"]
    assert out["after"][option] is True
    assert out["status"] == "succeeded", out["error"]
    assert out["device"]["graph_rewrite"] == option
    assert out["device"]["jit_compile"] is False  # XLA would bypass grappler, so it is off
    assert out["mode"] == "none"  # float32: auto mode needs no loss scale
    plain, rewrite = out["plain"], out["rewrite"]
    assert [r[0] for r in rewrite] == list(range(len(plain)))
    assert all(r[3] == 1.0 for r in rewrite)
    losses = [(p[2], r[2]) for p, r in zip(plain, rewrite, strict=True)]
    warnings = out["device"]["warnings"]
    cpu = CpuPrecision.detect()
    if cpu.onednn_bfloat16_rewrite:
        # The rewrite took effect: bfloat16 matmuls move the losses, though not by much.
        assert any(p != r for p, r in losses)
        assert all(abs(p - r) <= 0.05 * abs(p) for p, r in losses)
        assert not any("no-op" in w for w in warnings)
        assert any("emulated" in w for w in warnings) == (not cpu.bfloat16_native)
    else:
        # TensorFlow skips the rewrite on a CPU without AVX-512F or AVX-NE-CONVERT: the job
        # trains exactly as float32 does, and is told so.
        assert losses == [(p, p) for p, _ in losses]
        assert any("graph_rewrite on this CPU is a no-op" in w for w in warnings), warnings


def test_a_mixed_bfloat16_job_is_told_what_this_cpu_does_with_bfloat16(tmp_path: Path) -> None:
    spec = job_spec(tmp_path, precision={"policy": "mixed_bfloat16"}, training={"epochs": 1})
    run = run_job(spec, tmp_path / "job")
    assert run.status == "succeeded", run.error
    warnings = run.started["device"]["warnings"]
    emulated = any("bfloat16 arithmetic is emulated" in w for w in warnings)
    assert emulated == (not CpuPrecision.detect().bfloat16_native), warnings
