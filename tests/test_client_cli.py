"""The ``halfway`` client commands against a live server: the real app under uvicorn on a free
port (SQLite, and PostgreSQL when HALFWAY_TEST_DATABASE_URL is set), a real worker training
tiny Keras jobs for the watch and follow tests, and the CLI invoked as users invoke it: the
``halfway`` executable in a subprocess, or typer's CliRunner on ``service.cli.app``."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner, Result

from service.cli import app as cli_app
from service.client import Client, ExitCode, UsageError, resolve_target, tables, watching
from service.client import commands as client_commands
from service.database.models import Job, float32, utcnow
from service.recording import history
from service.recording.records import StepRecord
from service.scheduling import jobs
from tests import fakes
from tests.live import CLIENT_ENV, Live, free_port, halfway
from tests.waiting import eventually
from workers.supervisor import Supervisor

TINY: dict[str, Any] = {
    "data": {"samples": 256, "features": 8, "classes": 2},
    "model": {"input_size": 8, "hidden": [8], "num_classes": 2},
    "training": {"epochs": 2, "batch_size": 32},
}
TINY_YAML = """\
name: tiny-yaml
data: {samples: 256, features: 8, classes: 2}
model:
  input_size: 8
  hidden: [8]
  num_classes: 2
training: {epochs: 2, batch_size: 32}
"""


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process commands poll every 0.2 s instead of 1 s (subprocesses keep 1 s)."""
    monkeypatch.setattr(watching, "POLL_SECONDS", 0.2)


def cli(live: Live | None, *args: str, input: str | None = None, **env: str | None) -> Result:
    """``halfway ARGS`` in this process, as alice unless ``env`` says otherwise."""
    client_commands.register(cli_app)
    base = live.env() if live else {k: None for k in CLIENT_ENV}
    return CliRunner().invoke(cli_app, list(args), env=base | env, input=input)


def write_file(directory: Path, name: str, text: str) -> str:
    path = directory / name
    path.write_text(text)
    return str(path)


def finish_directly(
    live: Live,
    job_id: int,
    records: list[StepRecord],
    *,
    status: str = "succeeded",
    error: str | None = None,
    log: bytes | None = None,
) -> None:
    """Run a job to its end the way a worker records it (claim, history, log, finish), without
    training: for the commands that only read what a finished job left behind."""
    now = utcnow()
    with live.db.write() as s:
        claim = jobs.claim_next(s, worker_id="test-worker", lease_seconds=30, gpus_held=0)
        assert claim is not None and claim.job_id == job_id
        job = s.get(Job, job_id)
        assert job is not None
        job.total_steps = len(records)
        history.write_steps(s, job, records, now=now)
        if error is not None:
            assert jobs.record_attempt_error(
                s, job_id=job_id, worker_id="test-worker", attempt=1, error=error
            )
        assert jobs.finish(s, job_id=job_id, worker_id="test-worker", status=status, error=error)
    if log is not None:
        folder = live.settings.resolved_artifact_dir() / str(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train.log").write_bytes(log)


def records_with_overflows(n: int = 40) -> list[StepRecord]:
    """Overflows at steps 5 and 6 (scale halves after each), a NaN loss at step 7."""
    out, scale = [], 1024.0
    for step in range(n):
        finite = step not in (5, 6)
        loss = math.nan if step == 7 else 1.0 / (step + 1)
        out.append(StepRecord(step, step // 20, loss, scale, finite))
        if not finite:
            scale /= 2
    return out


def find_row(output: str, first_cell: str) -> list[str] | None:
    """The cells of the table row whose first non-empty cell is ``first_cell``."""
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and next((c for c in cells if c), None) == first_cell:
            return cells
    return None


def table_row(output: str, first_cell: str) -> list[str]:
    cells = find_row(output, first_cell)
    assert cells is not None, f"no row {first_cell!r} in:\n{output}"
    return cells


# --------------------------------------------------------------------------------------------
# submit


def test_submit_from_yaml_and_from_json_prints_the_id_warnings_and_notes(
    live: Live, tmp_path: Path
) -> None:
    from_yaml = cli(live, "submit", write_file(tmp_path, "spec.yaml", TINY_YAML))
    assert from_yaml.exit_code == 0, from_yaml.output
    assert "Submitted job 1 (tiny-yaml), queued." in from_yaml.stdout
    assert "note: loss_scale.mode 'auto' is 'dynamic'" in from_yaml.stdout

    unscaled = {**TINY, "name": "tiny-json", "loss_scale": {"mode": "none"}}
    from_json = cli(live, "submit", write_file(tmp_path, "spec.json", json.dumps(unscaled)))
    assert from_json.exit_code == 0, from_json.output
    assert "Submitted job 2 (tiny-json), queued." in from_json.stdout
    assert "warning: float16 compute without loss scaling" in from_json.stdout

    stored = {j["id"]: j for j in live.api("GET", "/v1/jobs")["items"]}
    assert stored[1]["name"] == "tiny-yaml" and stored[1]["owner"] == "alice"
    assert stored[1]["spec"]["model"]["hidden"] == [8]
    assert stored[2]["spec"]["loss_scale"]["mode"] == "none"


def test_submit_reads_stdin_dry_runs_and_replays_an_idempotency_key(
    live: Live, tmp_path: Path
) -> None:
    dry = cli(live, "submit", "-", "--dry-run", input=json.dumps(TINY))
    assert dry.exit_code == 0, dry.output
    assert "The spec is valid" in dry.stdout and '"growth_steps": 2000' in dry.stdout
    assert live.api("GET", "/v1/jobs")["items"] == []  # a dry run stores nothing

    spec = write_file(tmp_path, "spec.yaml", TINY_YAML)
    first = cli(live, "submit", spec, "--idempotency-key", "nightly-7")
    again = cli(live, "submit", spec, "--idempotency-key", "nightly-7")
    assert first.exit_code == again.exit_code == 0, first.output + again.output
    assert "Submitted job 1" in first.stdout
    assert "Job 1 (tiny-yaml) was already submitted" in again.stdout
    assert len(live.api("GET", "/v1/jobs")["items"]) == 1

    other = write_file(tmp_path, "other.json", json.dumps(TINY))
    reused = cli(live, "submit", other, "--idempotency-key", "nightly-7")
    assert reused.exit_code == ExitCode.CONFLICT
    assert "conflict: Idempotency-Key was already used with a different body" in reused.stderr


@pytest.mark.keras
def test_submit_watch_follows_a_real_job_to_success_in_the_halfway_executable(
    live: Live, worker: Supervisor, tmp_path: Path
) -> None:
    spec = {**TINY, "name": "watched", "faults": {"nonfinite_at_steps": [3]}}
    result = halfway(live, "submit", write_file(tmp_path, "spec.json", json.dumps(spec)), "-w")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Submitted job 1 (watched), queued." in out
    assert "job 1 running on" in out  # the transition, printed above the bar
    assert "16/16" in out and "epoch 2/2" in out  # the bar's final state
    assert "job 1 succeeded in" in out and "16 steps" in out and "1 overflow(s)" in out
    job = live.api("GET", "/v1/jobs/1")
    assert job["status"] == "succeeded" and job["summary"]["overflow_count"] == 1


@pytest.mark.keras
def test_submit_watch_of_a_failing_job_exits_non_zero_with_its_error(
    live: Live, worker: Supervisor, tmp_path: Path
) -> None:
    spec = {**TINY, "faults": {"crash_at_step": 3}, "max_attempts": 1}
    result = cli(live, "submit", write_file(tmp_path, "crash.json", json.dumps(spec)), "--watch")
    assert result.exit_code == ExitCode.JOB_FAILED, result.output
    assert "job 1 failed:" in result.stdout
    assert "injected crash at step 3" in result.stdout
    assert "halfway logs 1" in result.stdout


def test_submit_watch_says_when_a_resume_rewrites_history_and_goes_back_to_the_cut(
    live: Live, tmp_path: Path
) -> None:
    """A real supervisor, a fake trainer (a spawned process, no TensorFlow): attempt 1 trains
    0..199, checkpoints at 128 and is killed; attempt 2 resumes at 128 and trains to 299."""
    plan = [
        {"until": 200, "total": 300, "checkpoint_at": 128, "then": "crash"},
        {"until": 300, "total": 300},
    ]
    (live.settings.resolved_data_dir() / "fake-plan.json").write_text(json.dumps(plan))
    supervisor = Supervisor(live.db, live.settings, trainer=fakes.plan_in_data_dir)
    thread = threading.Thread(target=supervisor.run_forever, daemon=True)
    thread.start()
    try:
        result = cli(live, "submit", write_file(tmp_path, "spec.json", json.dumps(TINY)), "-w")
    finally:
        supervisor.stop()
        thread.join(30)
    assert result.exit_code == ExitCode.OK, result.output
    assert "attempt 1 failed: training process killed by signal 9" in result.stdout
    assert (
        "attempt 2 resumed from its checkpoint: history from step 128 on is being trained again"
        in result.stdout
    )
    assert "job 1 succeeded" in result.stdout and "300 steps" in result.stdout


# --------------------------------------------------------------------------------------------
# jobs, show, history


def test_jobs_lists_a_table_filtered_by_status_and_owner_with_a_cursor(live: Live) -> None:
    first = live.submit({**TINY, "name": "alpha"}, live.team.alice)
    live.submit({**TINY, "name": "beta"}, live.team.bob)
    finish_directly(live, first, records_with_overflows())

    everything = cli(live, "jobs")
    assert everything.exit_code == 0, everything.output
    alpha = table_row(everything.stdout, "1")
    assert alpha[1:7] == ["alpha", "alice", "succeeded", "40/40 (100%)", "256", "2"]
    assert table_row(everything.stdout, "2")[1:4] == ["beta", "bob", "queued"]

    bobs = cli(live, "jobs", "--owner", "bob")
    assert "beta" in bobs.stdout and "alpha" not in bobs.stdout
    done = cli(live, "jobs", "--status", "succeeded")
    assert "alpha" in done.stdout and "beta" not in done.stdout

    newest = cli(live, "jobs", "--limit", "1")
    assert "beta" in newest.stdout and "alpha" not in newest.stdout
    assert "Older jobs: halfway jobs --cursor 2" in newest.stdout
    older = cli(live, "jobs", "--limit", "1", "--cursor", "2")
    assert "alpha" in older.stdout and "beta" not in older.stdout


def test_show_prints_status_error_attempts_warnings_notes_summary_and_spec(live: Live) -> None:
    job_id = live.submit({**TINY, "name": "broken", "loss_scale": {"mode": "none"}})
    finish_directly(
        live, job_id, records_with_overflows(12), status="failed", error="RuntimeError: boom"
    )
    result = cli(live, "show", str(job_id))
    assert result.exit_code == 0, result.output
    out = result.stdout
    for expected in (
        "broken",
        "failed",
        "RuntimeError: boom",  # the error, and attempt 1's error
        "attempt 1",
        "warning",
        "float16 compute without loss scaling",
        "12/12 (100%), epoch 1/2",
        "2 step(s) with non-finite gradients, 1 non-finite loss(es)",
        "mlp 8 -> 8 -> 2 (relu)",
        "synthetic, 256 samples x 8 features, 2 classes",
        "tensorboard off",
    ):
        assert expected in out, f"{expected!r} not in:\n{out}"

    raw = cli(live, "show", str(job_id), "--json")
    assert raw.exit_code == 0, raw.output
    job = json.loads(raw.stdout)
    assert job["id"] == job_id and job["error"] == "RuntimeError: boom"


def test_show_prints_metrics_as_labelled_numbers(live: Live) -> None:
    job_id = live.submit(TINY)
    finish_directly(live, job_id, records_with_overflows(12))
    with live.db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.metrics = {
            "last_epoch": {"epoch": 1, "accuracy": 0.875},
            "timing": {"median_step_seconds": 0.0015, "peak_memory_bytes": 3 * 2**20},
        }
    out = cli(live, "show", str(job_id)).stdout
    assert table_line(out, "last_epoch: accuracy") == "0.875"
    assert table_line(out, "last_epoch: epoch") == "2"
    assert table_line(out, "timing: median_step_seconds") == "0.0015 s"
    assert table_line(out, "timing: peak_memory_bytes") == "3.0 MiB"
    assert "{" not in out


def code_job(live: Live, tmp_path: Path) -> int:
    """A queued code job of a one-function bundle (run as the admin, who may run code)."""
    package = tmp_path / "bundle" / "own"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("def build(args):\n    return {}\n")
    with Client(live.url, live.team.admin, env={}) as hw:
        digest = hw.push_code(tmp_path / "bundle")["digest"]
    spec = {"name": "own", "code": {"bundle": digest, "entrypoint": "own.train:build"}}
    return live.submit(spec, live.team.admin)


def test_show_of_a_code_job_prints_what_trained_not_the_specs_optimizer(
    live: Live, tmp_path: Path
) -> None:
    job_id = code_job(live, tmp_path)
    queued = cli(live, "show", str(job_id), HALFWAY_TOKEN=live.team.admin)
    assert queued.exit_code == 0, queued.output
    # Before the child has said what the bundle returned, the spec's optimizer is only the
    # fallback for a function that returns none; it is not presented as what trains.
    spec_line = table_line(queued.stdout, "spec: optimizer")
    assert spec_line != "adam, learning rate 0.001", queued.stdout
    assert spec_line.startswith("the bundle's"), spec_line
    assert "known once the job starts" in queued.stdout

    finish_directly(live, job_id, records_with_overflows(12))
    with live.db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        # What the training child reports in its "started" message (workers/training.py).
        job.device = {
            "optimizer": {
                "class": "Adam",
                "schedule": {
                    "class": "CosineDecay",
                    "initial_learning_rate": 0.0,
                    "warmup_target": 0.01,
                    "decay_steps": 60,
                },
            },
            "loss": "mse",
            "batch_size": 64,
        }
    out = eventually(
        lambda: cli(live, "show", str(job_id), HALFWAY_TOKEN=live.team.admin).stdout,
        lambda text: "CosineDecay" in text,
    )
    assert table_line(out, "optimizer") == (
        "Adam, learning rate CosineDecay(initial_learning_rate=0, warmup_target=0.01, "
        "decay_steps=60) (what trained)"
    )
    assert table_line(out, "loss function") == "mse"
    assert table_line(out, "batch size") == "64"
    assert "known once the job starts" not in out
    assert "adam, learning rate 0.001" not in out


def table_line(output: str, label: str) -> str:
    """The value printed after ``label`` on a line of ``halfway show``'s grid."""
    for line in output.splitlines():
        if line.strip().startswith(label + " "):
            return line.strip()[len(label) :].strip()
    raise AssertionError(f"no line {label!r} in:\n{output}")


def test_polling_a_job_that_has_not_changed_costs_an_empty_304(live: Live) -> None:
    job_id = live.submit(TINY)
    client = Client(live.url, live.team.alice)
    try:
        job, etag = client.job_if_changed(job_id, None)
        assert job is not None and job["status"] == "queued" and etag
        assert client.job_if_changed(job_id, etag) == (None, etag)
        live.api("POST", f"/v1/jobs/{job_id}/cancel")
        changed, new_etag = client.job_if_changed(job_id, etag)
        assert changed is not None and changed["status"] == "cancelled" and new_etag != etag
    finally:
        client.close()


def test_history_prints_rows_pages_with_after_step_and_marks_overflows(live: Live) -> None:
    job_id = live.submit(TINY)
    finish_directly(live, job_id, records_with_overflows())
    first = cli(live, "history", str(job_id), "--limit", "10")
    assert first.exit_code == 0, first.output
    assert table_row(first.stdout, "4")[:5] == ["4", "0", "0.2", "1024", "yes"]
    assert table_row(first.stdout, "5")[3:] == ["1024", "OVERFLOW (update skipped)"]
    assert table_row(first.stdout, "6")[3:] == ["512", "OVERFLOW (update skipped)"]
    assert table_row(first.stdout, "7")[2:4] == ["nan", "256"]
    assert f"More: halfway history {job_id} --after-step 9" in first.stdout
    assert find_row(first.stdout, "10") is None

    last = cli(live, "history", str(job_id), "--after-step", "35")
    assert [table_row(last.stdout, str(s))[0] for s in range(36, 40)] == ["36", "37", "38", "39"]
    assert "More:" not in last.stdout and find_row(last.stdout, "35") is None


def test_history_says_when_a_resume_rewrote_the_rows_it_prints(live: Live) -> None:
    job_id = live.submit(TINY)
    finish_directly(live, job_id, records_with_overflows())
    before = cli(live, "history", str(job_id), "--after-step", "20")
    assert "History version" not in before.stdout
    with live.db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        history.truncate_after(s, job, 30)
        history.write_steps(
            s, job, [StepRecord(i, 0, 0.5, 64.0, True) for i in range(30, 40)], now=utcnow()
        )
    after = eventually(
        lambda: cli(live, "history", str(job_id), "--after-step", "20"),
        lambda r: "History version" in r.stdout,
    )
    assert "History version 1: a resume trained the steps from 30 on again" in after.stdout
    assert table_row(after.stdout, "35")[3] == "64"
    buckets = cli(live, "history", str(job_id), "--points", "2")
    assert "History version 1" in buckets.stdout


def test_history_csv_streams_every_row(live: Live) -> None:
    job_id = live.submit(TINY)
    finish_directly(live, job_id, records_with_overflows())
    result = cli(live, "history", str(job_id), "--csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [int(r["step"]) for r in rows] == list(range(40))
    assert [int(r["step"]) for r in rows if r["finite"] == "false"] == [5, 6]
    assert math.isnan(float(rows[7]["loss"])) and float(rows[8]["loss"]) == pytest.approx(1 / 9)
    assert float(rows[39]["loss_scale"]) == 256.0


@pytest.mark.parametrize("kind", ["arrow", "parquet"])
def test_history_writes_every_row_to_an_arrow_or_parquet_file_in_the_halfway_executable(
    live: Live, tmp_path: Path, kind: str
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    job_id = live.submit(TINY)
    records = records_with_overflows()
    finish_directly(live, job_id, records)
    file = tmp_path / f"run.{kind}"
    result = halfway(live, "history", str(job_id), f"--{kind}", str(file))
    assert result.returncode == 0, result.stderr
    assert f"Wrote job {job_id}'s history to {file}" in result.stdout
    table = pq.read_table(file) if kind == "parquet" else pa.ipc.open_stream(file.read_bytes())
    cols = table.read_all().to_pydict() if kind == "arrow" else table.to_pydict()
    assert cols["step"] == [r.step for r in records]
    assert cols["epoch"] == [r.epoch for r in records]
    assert [s for s, f in zip(cols["step"], cols["finite"], strict=True) if not f] == [5, 6]
    assert math.isnan(cols["loss"][7])
    assert [v for i, v in enumerate(cols["loss"]) if i != 7] == [
        float32(r.loss) for r in records if r.step != 7
    ]
    assert cols["loss_scale"] == [r.loss_scale for r in records]

    missing = tmp_path / f"missing.{kind}"
    unknown = halfway(live, "history", "999", f"--{kind}", str(missing))
    assert unknown.returncode == ExitCode.NOT_FOUND, unknown.stderr
    assert not missing.exists() and list(tmp_path.glob("*.partial")) == []


def test_history_points_summarizes_buckets_and_marks_the_ones_with_overflows(
    live: Live,
) -> None:
    job_id = live.submit(TINY)
    finish_directly(live, job_id, records_with_overflows())
    result = cli(live, "history", str(job_id), "--points", "4")
    assert result.exit_code == 0, result.output
    assert "buckets of 10 step(s)" in result.stdout
    overflowed = table_row(result.stdout, "!")
    assert overflowed[1:3] == ["0-9", "10"]
    assert overflowed[6:10] == ["256", "1024", "256", "2"]  # scale min/max/last, overflows
    for quiet in ("10-19", "20-29", "30-39"):
        row = table_row(result.stdout, quiet)
        assert row[0] == "" and row[9] == "0"


def test_history_options_that_exclude_each_other_are_usage_errors(live: Live) -> None:
    both = cli(live, "history", "1", "--csv", "--points", "5")
    assert both.exit_code == ExitCode.USAGE and "choose one of --csv and --points" in both.stderr
    paged = cli(live, "history", "1", "--csv", "--limit", "5")
    assert paged.exit_code == ExitCode.USAGE and "--after-step and --limit" in paged.stderr
    files = cli(live, "history", "1", "--arrow", "a", "--parquet", "b")
    assert files.exit_code == ExitCode.USAGE and "--arrow and --parquet" in files.stderr
    paged_file = cli(live, "history", "1", "--parquet", "b", "--after-step", "5")
    assert paged_file.exit_code == ExitCode.USAGE and "not with --parquet" in paged_file.stderr


# --------------------------------------------------------------------------------------------
# cancel, logs, tensorboard


def test_cancel_a_queued_job_and_a_finished_one_is_a_conflict(live: Live) -> None:
    queued = live.submit(TINY)
    result = cli(live, "cancel", str(queued))
    assert result.exit_code == 0, result.output
    assert f"Job {queued} cancelled." in result.stdout
    assert live.api("GET", f"/v1/jobs/{queued}")["status"] == "cancelled"

    finished = live.submit(TINY)
    finish_directly(live, finished, records_with_overflows(4))
    again = cli(live, "cancel", str(finished))
    assert again.exit_code == ExitCode.CONFLICT
    assert f"conflict: job {finished} already finished: succeeded" in again.stderr


def test_cancel_of_someone_elses_job_is_forbidden(live: Live) -> None:
    job_id = live.submit(TINY, live.team.alice)
    result = cli(live, "cancel", str(job_id), HALFWAY_TOKEN=live.team.bob)
    assert result.exit_code == ExitCode.FORBIDDEN
    assert "forbidden: only alice or an admin may cancel this job" in result.stderr


def test_logs_prints_the_log_as_is(live: Live) -> None:
    job_id = live.submit(TINY)
    log = b"epoch 1/2\n[bold]not markup[/bold] \xc3\xa9t\xc3\xa9\nepoch 2/2\n"
    finish_directly(live, job_id, records_with_overflows(4), log=log)
    result = cli(live, "logs", str(job_id))
    assert result.exit_code == 0, result.output
    assert result.stdout_bytes == log

    empty = cli(live, "logs", str(live.submit(TINY)))
    assert empty.exit_code == 0 and empty.stdout == ""
    assert "has no log yet" in empty.stderr


@pytest.mark.keras
def test_logs_follow_streams_a_real_job_and_ends_when_the_job_ends(
    live: Live, worker: Supervisor
) -> None:
    job_id = live.submit(TINY)
    result = cli(live, "logs", str(job_id), "--follow")
    assert result.exit_code == 0, result.output
    # From the child's first line to its last: the whole log, each line once.
    assert result.stdout.count(f"halfway: job {job_id} attempt 1 starting") == 1
    assert result.stdout.rstrip().endswith("halfway: child exiting")
    assert f"Job {job_id} succeeded." in result.stderr
    log = live.settings.resolved_artifact_dir() / str(job_id) / "train.log"
    assert result.stdout_bytes == log.read_bytes()


def test_tensorboard_prints_the_logdir_and_says_when_the_spec_did_not_enable_it(
    live: Live,
) -> None:
    on = live.submit({**TINY, "outputs": {"tensorboard": True}})
    artifacts = str(live.settings.resolved_artifact_dir())
    result = cli(live, "tensorboard", str(on), "--artifact-dir", artifacts)
    assert result.exit_code == 0, result.output
    assert f"tensorboard --logdir {artifacts}/{on}/tensorboard" in result.stdout
    assert "outputs.tensorboard is on for this job." in result.stdout

    off = live.submit(TINY)
    default = cli(
        live, "tensorboard", str(off), HALFWAY_HOME="/srv/halfway", HALFWAY_ARTIFACT_DIR=None
    )
    assert default.exit_code == 0, default.output
    assert f"tensorboard --logdir /srv/halfway/artifacts/{off}/tensorboard" in default.stdout
    assert f"Job {off} did not enable TensorBoard" in default.stdout
    assert "tensorboard: true" in default.stdout


# --------------------------------------------------------------------------------------------
# Failures


def test_a_server_that_is_down_is_exit_3_with_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = halfway(None, "jobs", "--url", url, env={"HALFWAY_TOKEN": "hw_x"})
    assert result.returncode == 3 == ExitCode.UNREACHABLE.value
    assert f"error: cannot reach Halfway at {url}: " in result.stderr
    assert "Connection refused" in result.stderr and result.stdout == ""


def test_no_token_and_a_bad_token_are_401s_that_say_how_to_fix_it(live: Live) -> None:
    missing = cli(live, "jobs", HALFWAY_TOKEN=None)
    assert missing.exit_code == ExitCode.UNAUTHORIZED
    assert "token missing or invalid; set HALFWAY_TOKEN or --token" in missing.stderr
    assert "no token was sent" in missing.stderr

    bad = cli(live, "show", "1", "--token", "hw_wrong")
    assert bad.exit_code == ExitCode.UNAUTHORIZED
    assert "invalid token (the token came from --token)" in bad.stderr


def test_an_unknown_job_is_a_404_for_every_command(live: Live) -> None:
    for args in (
        ["show", "999"],
        ["history", "999"],
        ["history", "999", "--csv"],
        ["cancel", "999"],
        ["logs", "999"],
        ["tensorboard", "999"],
    ):
        result = cli(live, *args)
        assert result.exit_code == ExitCode.NOT_FOUND, (args, result.output)
        assert "not found: job 999 does not exist" in result.stderr
        assert result.stdout == ""


def test_an_invalid_spec_is_a_422_that_prints_each_field_and_rule(
    live: Live, tmp_path: Path
) -> None:
    spec = {
        **TINY,
        "precision": {"policy": {"variable_dtype": "float16", "compute_dtype": "float32"}},
        "training": {"epochs": 0},
    }
    result = cli(live, "submit", write_file(tmp_path, "bad.json", json.dumps(spec)))
    assert result.exit_code == ExitCode.INVALID
    assert "error: the server refused the input:" in result.stderr
    assert "precision.policy: " in result.stderr
    assert "(rule: unexpressible_policy)" in result.stderr
    assert "training.epochs: Input should be greater than or equal to 1" in result.stderr
    assert live.api("GET", "/v1/jobs")["items"] == []


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.yaml", None, "spec file {path} not found"),
        ("empty.yaml", "  \n", "spec file {path} is empty"),
        ("broken.json", '{"data": {', "spec file {path} is not valid JSON: "),
        ("broken.yaml", "data: [1, 2\nmodel: {", "spec file {path} is not valid YAML"),
        ("list.yaml", "- 1\n- 2\n", "must hold a mapping of sections"),
        ("binary.json", "\udcff\udcfe", "spec file {path} is not UTF-8 text"),
    ],
)
def test_an_unreadable_spec_file_is_a_usage_error(
    tmp_path: Path, name: str, content: str | None, message: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content.encode("utf-8", "surrogateescape"))
    result = cli(None, "submit", str(path), "--url", "http://127.0.0.1:9")
    assert result.exit_code == ExitCode.USAGE, result.output
    assert message.format(path=path) in result.stderr


def test_a_directory_as_spec_and_watch_with_dry_run_are_usage_errors(tmp_path: Path) -> None:
    folder = cli(None, "submit", str(tmp_path))
    assert folder.exit_code == ExitCode.USAGE and "is a directory" in folder.stderr
    both = cli(None, "submit", "x.yaml", "--watch", "--dry-run")
    assert both.exit_code == ExitCode.USAGE and "exclude each other" in both.stderr


# --------------------------------------------------------------------------------------------
# Configuration


def owner_of_new_job(live: Live, result: Result) -> str:
    assert result.exit_code == 0, result.output
    newest = live.api("GET", "/v1/jobs", params={"limit": 1})["items"][0]
    assert f"Submitted job {newest['id']}" in result.stdout
    owner: str = newest["owner"]
    return owner


def test_flag_beats_environment_beats_config_file(live: Live, tmp_path: Path) -> None:
    spec = write_file(tmp_path, "spec.json", json.dumps(TINY))
    config = live.home / ".config" / "halfway" / "client.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f'url = "{live.url}"\ntoken = "{live.team.alice}"\n')
    config.chmod(0o600)
    nothing_else = {"HALFWAY_URL": None, "HALFWAY_TOKEN": None}

    from_file = cli(live, "submit", spec, **nothing_else)
    assert owner_of_new_job(live, from_file) == "alice"
    assert "warning" not in from_file.stderr  # a private config file is not nagged about

    from_env = cli(live, "submit", spec, HALFWAY_URL=None, HALFWAY_TOKEN=live.team.bob)
    assert owner_of_new_job(live, from_env) == "bob"

    from_flag = cli(live, "submit", spec, "--token", live.team.admin, HALFWAY_TOKEN=live.team.bob)
    assert owner_of_new_job(live, from_flag) == "root"

    dead = f"http://127.0.0.1:{free_port()}"
    config.write_text(f'url = "{dead}"\ntoken = "{live.team.alice}"\n')
    url_from_env = cli(live, "submit", spec, HALFWAY_URL=live.url, HALFWAY_TOKEN=None)
    assert owner_of_new_job(live, url_from_env) == "alice"
    url_from_flag = cli(live, "submit", spec, "--url", live.url, HALFWAY_URL=dead)
    assert owner_of_new_job(live, url_from_flag) == "alice"
    from_dead_file = cli(live, "jobs", **nothing_else)
    assert from_dead_file.exit_code == ExitCode.UNREACHABLE
    assert f"cannot reach Halfway at {dead}" in from_dead_file.stderr


def test_halfway_config_names_a_yaml_file_and_must_exist(live: Live, tmp_path: Path) -> None:
    config = tmp_path / "team.yaml"
    config.write_text(f"url: {live.url}\ntoken: {live.team.bob}\n")
    config.chmod(0o644)
    result = cli(live, "jobs", HALFWAY_URL=None, HALFWAY_TOKEN=None, HALFWAY_CONFIG=str(config))
    assert result.exit_code == 0, result.output
    assert "holds a token and other users can read it; run: chmod 600" in result.stderr

    gone = cli(live, "jobs", HALFWAY_CONFIG=str(tmp_path / "nope.toml"))
    assert gone.exit_code == ExitCode.USAGE
    assert "nope.toml (from HALFWAY_CONFIG) not found" in gone.stderr

    config.write_text("url: http://x\ntokn: typo\n")
    typo = cli(live, "jobs", HALFWAY_CONFIG=str(config), HALFWAY_URL=None)
    assert typo.exit_code == ExitCode.USAGE and "unknown key(s) tokn" in typo.stderr


def test_resolve_target_defaults_and_refuses_a_url_without_scheme(tmp_path: Path) -> None:
    empty = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    assert resolve_target(None, None, empty).url == "http://127.0.0.1:8000"
    assert resolve_target(None, None, empty).token is None
    assert resolve_target("http://h:1/", "t", empty).url == "http://h:1"
    with pytest.raises(UsageError) as refused:
        resolve_target(None, None, {**empty, "HALFWAY_URL": "localhost:8000"})
    assert refused.value.code == ExitCode.USAGE
    assert "(from HALFWAY_URL)" in refused.value.message


def sweep_result(name: str) -> dict[str, Any]:
    def variant(i: int, policy: str) -> dict[str, Any]:
        return {
            "job_id": i + 1,
            "name": f"{name}/{policy}",
            "status": "succeeded",
            "error": None,
            "policy": policy,
            "loss_scale_mode": "dynamic",
            "examples_per_second": 21345.678 / (i + 1),
            "median_step_seconds": 0.0015 * (i + 1),
            "speedup_vs_float32": 1.0 / (i + 1),
            "time_to_target_seconds": 12.5,
            "step_to_target": 1500,
            "final_loss": 0.123456,
            "final_metrics": {"val_loss": 0.2345, "val_accuracy": 0.9123},
            "overflow_count": 3,
            "skipped_steps": 3,
            "final_loss_scale": 32768.0,
            "min_loss_scale": 16384.0,
            "peak_memory_bytes": 123 * 2**20,
        }

    policies = ("float32", "mixed_float16", "mixed_bfloat16")
    return {
        "id": 7,
        "name": name,
        "done": True,
        "variants": [variant(i, p) for i, p in enumerate(policies)],
    }


@pytest.mark.parametrize("width", [100, 250])
def test_sweep_table_shows_each_variants_own_name_and_fits_the_terminal(width: int) -> None:
    console = Console(width=width, record=True)
    console.print(tables.sweep_table(sweep_result("which-precision"), width))
    out = console.export_text()
    assert max(len(line) for line in out.splitlines()) <= width
    assert "…" not in out
    for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
        assert table_row(out, policy)[0] == policy
    assert "vs float32" in out and "0.50x" in out
    if width == 100:
        assert "hidden to fit:" in out and "peak mem" in out.split("hidden to fit:")[1]
    else:
        assert "hidden to fit" not in out and "123 MiB" in out


def claim_and_write(live: Live, job_id: int, records: list[StepRecord], total: int) -> None:
    """A worker's claim and its first steps: the job is running, ``len(records)`` of ``total``."""
    with live.db.write() as s:
        claim = jobs.claim_next(s, worker_id="test-worker", lease_seconds=30, gpus_held=0)
        assert claim is not None and claim.job_id == job_id
        job = s.get(Job, job_id)
        assert job is not None
        job.total_steps = total
        history.write_steps(s, job, records, now=utcnow())


def end_with(
    live: Live, job_id: int, records: list[StepRecord], status: str, error: str | None = None
) -> None:
    with live.db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        history.write_steps(s, job, records, now=utcnow())
        assert jobs.finish(s, job_id=job_id, worker_id="test-worker", status=status, error=error)


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_sweep_shows_each_variants_status_steps_and_loss_while_it_runs(
    live: Live, tmp_path: Path
) -> None:
    spec_file = write_file(tmp_path, "spec.yaml", TINY_YAML)
    done: list[Result] = []
    # A terminal (as rich sees one), so the bars are drawn live, frame by frame.
    runner = threading.Thread(
        target=lambda: done.append(
            cli(
                live,
                "sweep",
                spec_file,
                "--policies",
                "float32,mixed_float16",
                TTY_COMPATIBLE="1",
                TTY_INTERACTIVE="1",
                COLUMNS="160",
            )
        )
    )
    runner.start()
    page = eventually(lambda: live.api("GET", "/v1/jobs"), lambda p: len(p["items"]) == 2)
    first, second = sorted(j["id"] for j in page["items"])
    records = records_with_overflows(12)
    claim_and_write(live, first, records[:5], total=12)
    time.sleep(2.0)  # a few of the command's polls see it running at 5/12
    end_with(live, first, records[5:], "succeeded")
    claim_and_write(live, second, records[:3], total=12)
    end_with(live, second, [], "failed", error="RuntimeError: boom")
    runner.join(timeout=60)
    assert done, "the sweep command did not end"
    result = done[0]
    assert result.exit_code == ExitCode.JOB_FAILED, result.output
    out = ANSI.sub("", result.stdout)
    # A live frame: the first variant running, at step 5 of 12, its last loss 1/5.
    assert re.search(r"float32\s+running\s.*\b5/12\b.*loss 0\.2\b", out), out
    # Each change on a line of its own, as in a log.
    assert f"float32: job {first} running on test-worker" in out, out
    assert "float32: succeeded" in out and "12 steps" in out, out
    assert "mixed_float16: failed: RuntimeError: boom" in out, out
    # Then the table.
    assert table_row(out, "float32")[1] == "succeeded"
    assert table_row(out, "mixed_float16")[1] == "failed"
