"""Every file in examples/ runs as the docs say, through the real ``halfway`` executable,
against a live server with a real worker, and does what its comments promise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.live import Live, halfway
from tests.reference import expected_scales
from workers.cpu import CpuPrecision

pytestmark = pytest.mark.keras

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def history(live: Live, job_id: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    after = -1
    while True:
        page = live.api("GET", f"/v1/jobs/{job_id}/history?after_step={after}&limit=10000")
        rows += page["items"]
        after = page["next_after_step"]
        if not page["has_more"]:
            return rows


def submit_and_watch(live: Live, name: str) -> dict[str, Any]:
    # The examples train in full, in their own policy; the sweep trains three of them.
    result = halfway(live, "submit", str(EXAMPLES / name), "--watch", timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    page = live.api("GET", "/v1/jobs?limit=1")
    job: dict[str, Any] = page["items"][0]
    assert job["status"] == "succeeded"
    assert "succeeded" in result.stdout + result.stderr
    return job


def test_classic(live: Live, worker: Any) -> None:
    job = submit_and_watch(live, "classic.json")
    rows = history(live, job["id"])
    assert len(rows) == job["progress"]["total_steps"] == 5 * 313
    assert job["spec"]["precision"]["policy"] == "mixed_float16"
    # As TensorFlow in the child reported it: off where oneDNN's float16 kernels are the slow
    # ones (a CPU with float16 instructions), on elsewhere.
    assert job["device"]["onednn"] is not CpuPrecision.detect().float16_native


def test_bfloat16(live: Live, worker: Any) -> None:
    job = submit_and_watch(live, "bfloat16.yaml")
    assert job["spec"]["loss_scale"]["mode"] == "none"
    assert {r["loss_scale"] for r in history(live, job["id"])} == {1.0}
    dense = next(r for r in job["precision_report"] if r["layer"] == "dense_0")
    assert dense["compute_dtype"] == "bfloat16" and dense["variable_dtype"] == "float32"
    assert job["device"]["onednn"] is True  # bfloat16 keeps oneDNN on every CPU


def test_fixed_scale(live: Live, worker: Any) -> None:
    job = submit_and_watch(live, "fixed-scale.yaml")
    rows = history(live, job["id"])
    assert {r["loss_scale"] for r in rows} == {1024.0}
    assert [r["step"] for r in rows if not r["finite"]] == [40]
    assert job["summary"]["metrics"]["timing"]["updates_applied"] == len(rows) - 1


def test_overflow_rehearsal(live: Live, worker: Any) -> None:
    spec = yaml.safe_load((EXAMPLES / "overflow-rehearsal.yaml").read_text())
    job = submit_and_watch(live, "overflow-rehearsal.yaml")
    rows = history(live, job["id"])
    finite = [r["finite"] for r in rows]
    assert set(spec["faults"]["nonfinite_at_steps"]) <= {i for i, ok in enumerate(finite) if not ok}
    knobs = spec["loss_scale"]
    assert [r["loss_scale"] for r in rows] == expected_scales(
        finite,
        initial=knobs["initial_scale"],
        growth_steps=knobs["growth_steps"],
        hysteresis=knobs["hysteresis"],
        max_scale=knobs["max_scale"],
    )
    assert [f["step"] for f in job["forensics"]] == [20, 60, 61]
    events = live.api("GET", f"/v1/jobs/{job['id']}/loss-scale/events")
    assert events["overflow_events"] >= 1 and events["growth_events"] >= 1


def test_sweep(live: Live, worker: Any) -> None:
    # A 100-column terminal: secondary columns give way, each variant keeps its own name.
    # It trains the example's three policies one after another, and on a CPU with float16
    # instructions TensorFlow's float16 kernels are far slower than float32: the
    # mixed_float16 job alone can take minutes there.
    result = halfway(
        live, "sweep", str(EXAMPLES / "sweep.yaml"), env={"COLUMNS": "100"}, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert max(len(line) for line in out.splitlines()) <= 100
    for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
        assert any(
            line.split("│")[1].strip() == policy for line in out.splitlines()[3:] if "│" in line
        ), out
    assert "vs float32" in out and "1.00x" in out


def test_underflow(live: Live, worker: Any) -> None:
    """At a fixed scale of 1 the deep sigmoid net loses gradient to float16, and says so."""
    job = submit_and_watch(live, "underflow.yaml")
    page = live.api("GET", f"/v1/jobs/{job['id']}/gradients?limit=1000")
    samples = page["samples"]
    assert [s["step"] for s in samples] == list(range(0, 128, 16))
    assert all(s["shadow"] and s["loss_scale"] == 1.0 for s in samples)
    assert min(s["lost_share"] for s in samples) > 0.05
    first_layer = next(v for v in samples[0]["variables"] if v["name"].endswith("dense_0/kernel"))
    assert first_layer["lost_share"] > samples[0]["lost_share"]  # the far end loses most
    (alarm,) = [w for w in job["warnings"] if w.startswith("gradient underflow")]
    assert "dense_0/kernel" in alarm
    shown = halfway(live, "gradients", str(job["id"]), "--variables")
    assert shown.returncode == 0 and "dense_0/kernel" in shown.stdout


def test_auto(live: Live, worker: Any) -> None:
    """auto chooses by the documented rule from the probes it recorded, on this CPU."""
    from workers.autoprecision import decide

    job = submit_and_watch(live, "auto.yaml")
    decision = job["precision_decision"]
    probes = decision["probes"]
    assert [p["policy"] for p in probes] == ["float32", "mixed_bfloat16", "mixed_float16"]
    assert all(p["steps"] >= 25 and p["median_step_seconds"] > 0 for p in probes)
    cfg = job["spec"]["precision"]["probe"]
    again = decide([{**p, "eligible": False, "why": ""} for p in probes], cfg)
    assert again["policy"] == decision["policy"] and again["reason"] == decision["reason"]
    assert job["spec"]["precision"]["policy"] == "auto"
    dense = next(r for r in job["precision_report"] if r["layer"] == "dense_0")
    assert dense["policy"] == decision["policy"]
    assert len(history(live, job["id"])) == job["progress"]["total_steps"] == 128
    shown = halfway(live, "show", str(job["id"]))
    assert decision["policy"] in shown.stdout and "mixed_bfloat16" in shown.stdout
