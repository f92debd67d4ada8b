"""``service.client.Client``, the public Python API, against a live server (the real app under
uvicorn, SQLite and PostgreSQL) and, where a job must train, a real worker."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from service.client import (
    Client,
    Conflict,
    ExitCode,
    Forbidden,
    Invalid,
    NotFound,
    Unauthorized,
    Unreachable,
)
from service.database.models import Job, float32
from service.recording.records import StepRecord
from tests.live import Live, free_port
from tests.test_client_cli import TINY, finish_directly, records_with_overflows
from tests.waiting import eventually
from workers.supervisor import Supervisor

ROOT = Path(__file__).resolve().parent.parent


def client(live: Live, token: str | None = None) -> Client:
    return Client(live.url, token or live.team.alice, env={})


def endpoint_rows(live: Live, job_id: int) -> list[dict[str, Any]]:
    """Every row as the history endpoint serves it, paged with its cursor."""
    rows: list[dict[str, Any]] = []
    after = -1
    while True:
        page = live.api("GET", f"/v1/jobs/{job_id}/history?after_step={after}&limit=7")
        rows += page["items"]
        if not page["has_more"]:
            return rows
        after = page["next_after_step"]


def assert_frame_equals_rows(frame: pd.DataFrame, rows: list[dict[str, Any]]) -> None:
    assert list(frame.columns) == ["step", "epoch", "loss", "loss_scale", "finite"]
    assert len(frame) == len(rows)
    flags = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
    for got, want in zip(frame.itertuples(index=False), rows, strict=True):
        loss = want["loss"] if want["loss"] is not None else flags[want["loss_nonfinite"]]
        assert (got.step, got.epoch, got.loss_scale, got.finite) == (
            want["step"],
            want["epoch"],
            want["loss_scale"],
            want["finite"],
        )
        got_loss = float(got.loss)  # type: ignore[arg-type]
        assert (math.isnan(got_loss) and math.isnan(loss)) or got_loss == loss


def test_submit_dry_run_and_an_idempotent_replay(live: Live) -> None:
    with client(live) as hw:
        checked = hw.submit(TINY, dry_run=True)
        assert checked["spec"]["precision"]["policy"] == "mixed_float16"
        assert hw.jobs()["items"] == []  # a dry run stores nothing
        first = hw.submit(TINY, idempotency_key="k-1")
        again, replayed = hw.post_job(TINY, idempotency_key="k-1")
        assert replayed and again["id"] == first["id"]
        assert first["status"] == "queued" and first["owner"] == "alice"


def test_job_jobs_filters_and_cursor(live: Live) -> None:
    ids = [live.submit(TINY), live.submit(TINY), live.submit(TINY, live.team.bob)]
    with client(live) as hw:
        assert hw.job(ids[0])["id"] == ids[0]
        everyone = hw.jobs()
        assert [j["id"] for j in everyone["items"]] == ids[::-1]
        assert [j["owner"] for j in hw.jobs(owner="bob")["items"]] == ["bob"]
        first = hw.jobs(limit=2)
        assert [j["id"] for j in first["items"]] == [ids[2], ids[1]]
        rest = hw.jobs(limit=2, cursor=first["next_cursor"])
        assert [j["id"] for j in rest["items"]] == [ids[0]]
        hw.cancel(ids[0])
        assert [j["id"] for j in hw.jobs(status="cancelled")["items"]] == [ids[0]]


def test_each_failure_is_its_typed_exception_with_the_cli_exit_code(live: Live) -> None:
    job_id = live.submit(TINY)
    with pytest.raises(Unauthorized) as unauthorized:
        client(live, "hw_not-a-token").job(job_id)
    assert unauthorized.value.code == ExitCode.UNAUTHORIZED
    with pytest.raises(Forbidden) as forbidden:
        client(live, live.team.bob).cancel(job_id)
    assert forbidden.value.code == ExitCode.FORBIDDEN
    with pytest.raises(NotFound) as missing:
        client(live).job(job_id + 1000)
    assert missing.value.code == ExitCode.NOT_FOUND
    hw = client(live)
    hw.submit(TINY, idempotency_key="once")
    with pytest.raises(Conflict) as conflict:
        hw.submit({**TINY, "name": "another"}, idempotency_key="once")
    assert conflict.value.code == ExitCode.CONFLICT
    bad = {**TINY, "training": {"epochs": 0, "batch_size": 32}}
    with pytest.raises(Invalid) as invalid:
        hw.submit(bad)
    assert invalid.value.code == ExitCode.INVALID
    assert [f["field"] for f in invalid.value.fields] == ["training.epochs"]
    with pytest.raises(Unreachable) as down:
        Client(f"http://127.0.0.1:{free_port()}", "hw_x", env={}).job(1)
    assert down.value.code == ExitCode.UNREACHABLE and "cannot reach Halfway" in down.value.message


def test_history_of_a_finished_job_has_every_row_with_nan_and_inf_as_floats(live: Live) -> None:
    # Losses as the worker sends them: float32 values (the table's REAL).
    records = [r._replace(loss=float32(r.loss)) for r in records_with_overflows(30)]
    records[9] = StepRecord(9, 0, math.inf, records[9].loss_scale, True)
    records[10] = StepRecord(10, 0, -math.inf, records[10].loss_scale, True)
    job_id = live.submit(TINY)
    finish_directly(live, job_id, records)
    frame = client(live).history(job_id)
    assert_frame_equals_rows(frame, endpoint_rows(live, job_id))
    assert math.isnan(frame.loss[7]) and frame.loss[9] == math.inf and frame.loss[10] == -math.inf
    assert frame.finite.tolist() == [r.finite for r in records]
    assert str(frame.step.dtype) == "int64" and str(frame.finite.dtype) == "bool"


def test_buckets_and_scale_events(live: Live) -> None:
    job_id = live.submit(TINY)
    finish_directly(live, job_id, records_with_overflows(40))
    with client(live) as hw:
        page = hw.buckets(job_id, 4)
        assert sum(b["count"] for b in page["buckets"]) == 40
        assert sum(b["overflow_count"] for b in page["buckets"]) == 2
        events = hw.scale_events(job_id)
    # Overflows at steps 5 and 6: steps 6 and 7 are the first to use each halved scale.
    assert [(e["step"], e["reason"], e["new_scale"]) for e in events] == [
        (6, "overflow", 512.0),
        (7, "overflow", 256.0),
    ]


@pytest.mark.keras
def test_wait_reports_progress_and_history_equals_the_endpoint_for_a_trained_job(
    live: Live, worker: Supervisor
) -> None:
    spec = {**TINY, "faults": {"nonfinite_at_steps": [3, 4]}}
    seen: list[int | None] = []
    with client(live) as hw:
        job = hw.submit(spec)
        final = hw.wait(job["id"], lambda j: seen.append(j["progress"]["step"]), poll_seconds=0.2)
        assert final["status"] == "succeeded", final["error"]
        frame = hw.history(job["id"])
    assert seen and seen[-1] == final["progress"]["step"]
    assert frame.step.tolist() == list(range(final["progress"]["step"]))
    assert frame.index[~frame.finite].tolist() == [3, 4]
    assert_frame_equals_rows(frame, endpoint_rows(live, job["id"]))


@pytest.mark.keras
def test_a_sweep_waits_for_every_variant_and_returns_the_table(
    live: Live, worker: Supervisor
) -> None:
    with client(live) as hw:
        table = hw.sweep(TINY, policies=["float32", "mixed_float16"], poll_seconds=0.3)
    assert table.attrs["done"]
    assert table.status.tolist() == ["succeeded", "succeeded"], table
    assert table.policy.tolist() == ["float32", "mixed_float16"]
    assert all(math.isfinite(loss) for loss in table.final_loss), table
    assert table.job_id.nunique() == 2


def test_a_sweep_is_a_dataframe_one_row_per_variant_with_the_comparison_as_columns(
    live: Live,
) -> None:
    with client(live) as hw:
        started = hw.sweep(
            {"name": "which", "base": TINY},
            policies=["float32", "mixed_float16"],
            target_loss=0.5,
            wait=False,
        )
        assert isinstance(started, pd.DataFrame)
        # Indexed by each variant's own name; the sweep itself is in attrs.
        assert started.index.tolist() == ["float32", "mixed_float16"]
        assert started.attrs["name"] == "which" and started.attrs["done"] is False
        assert started.attrs["target_loss"] == 0.5
        assert started.status.tolist() == ["queued", "queued"]
        sweep_id = started.attrs["sweep_id"]
        first, second = started.job_id.tolist()
        finish_directly(live, first, records_with_overflows(12))
        finish_directly(live, second, records_with_overflows(12))
        with live.db.write() as s:
            job = s.get(Job, first)
            assert job is not None
            job.metrics = {"last_epoch": {"epoch": 0, "loss": 0.25, "val_loss": 0.5}}
        raw = eventually(lambda: hw.get_sweep(sweep_id), lambda t: t["done"])
        frame = hw.sweep_results(sweep_id)
    assert frame.attrs["done"] is True and frame.attrs["sweep_id"] == sweep_id
    for column in (
        "job_id",
        "status",
        "policy",
        "loss_scale_mode",
        "examples_per_second",
        "median_step_seconds",
        "speedup_vs_float32",
        "time_to_target_seconds",
        "step_to_target",
        "final_loss",
        "overflow_count",
        "skipped_steps",
        "final_loss_scale",
        "min_loss_scale",
        "peak_memory_bytes",
    ):
        assert column in frame.columns, column
    assert frame.status.tolist() == ["succeeded", "succeeded"]
    assert frame.overflow_count.tolist() == [2, 2]
    assert frame.loc["float32", "final_loss"] == 0.25
    # The last epoch's other metrics, one column each (NaN where a variant has none).
    assert frame.loc["float32", "final_val_loss"] == 0.5
    assert frame.final_val_loss.isna().tolist() == [False, True]
    # Numbers are numbers, also where the server had none (no GPU: no peak memory).
    assert str(frame.peak_memory_bytes.dtype) == "float64"
    assert str(frame.overflow_count.dtype) == "int64"
    # The JSON stays one call away.
    assert [v["job_id"] for v in raw["variants"]] == [first, second]


def test_history_without_pandas_says_how_to_install_it(live: Live, tmp_path: Path) -> None:
    # A fresh interpreter where importing pandas fails, as on a machine without the extra.
    blocker = tmp_path / "pandas.py"
    blocker.write_text("raise ImportError('no pandas here')\n")
    script = (
        "import sys\n"
        "from service.client import Client\n"
        "try:\n"
        f"    Client({live.url!r}, {live.team.alice!r}, env={{}}).history(1)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "pip install 'halfway[client]'" in done.stdout, done.stderr


def test_submit_with_a_code_dir_packs_uploads_and_fills_the_bundle(live: Live) -> None:
    spec = yaml.safe_load((ROOT / "examples" / "own-code" / "job.yaml").read_text())
    bundle_dir = ROOT / "examples" / "own-code" / "bundle"
    with client(live, live.team.admin) as hw:
        checked = hw.submit(spec, bundle_dir, dry_run=True)
        pushed = hw.push_code(bundle_dir)
        assert not pushed["created"]  # the dry run's upload stored it already
        assert checked["spec"]["code"]["bundle"] == pushed["digest"]
        listed = hw.code(pushed["digest"])
        assert "regression/train.py" in json.dumps(listed)
        assert "bundle" not in spec["code"]  # the caller's spec is left as it was
    with pytest.raises(Forbidden):
        client(live).submit(spec, bundle_dir)  # alice may not run code (admins only)
