"""Quiet by default: a CPU job's log holds no TensorFlow GPU-probe noise (yet every real error
and traceback), a GPU job's keeps it, and the first start says one line per migration step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

import migrations
from service.database.db import Database
from service.settings import Settings
from tests.conftest import Api
from tests.live import HALFWAY, free_port
from tests.test_training_keras import spec, submit
from workers.supervisor import Supervisor

ROOT = Path(__file__).resolve().parent.parent

# What TensorFlow 2.21 prints on every import and device listing on a host without a GPU.
PROBE = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1796287170.165747   25930 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.\n"
)
CUINIT = (
    "E0000 00:00:1796287179.807544   25930 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
)


def probe_noise_in(log: str) -> list[str]:
    return [
        line
        for line in log.splitlines()
        if "cuInit" in line or "cudart_stub" in line or "absl::InitializeLog" in line
    ]


# The job log --------------------------------------------------------------------------------


@pytest.mark.keras
def test_a_failing_cpu_jobs_log_has_its_traceback_and_no_gpu_probe_noise(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = submit(api, spec(training={"epochs": 1}, faults={"crash_at_step": 3}, max_attempts=1))
    Supervisor(db, settings).run_once()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "failed", job
    log = (settings.resolved_artifact_dir() / str(job_id) / "train.log").read_text()
    assert probe_noise_in(log) == [], log
    lines = log.splitlines()
    assert lines[0] == f"halfway: job {job_id} attempt 1 starting", log
    traceback_at = lines.index("Traceback (most recent call last):")
    assert "RuntimeError: injected crash at step 3 (faults.crash_at_step)" in lines[traceback_at:]
    assert lines[-1] == "halfway: child exiting", log


# The filter itself, in a child process that imports no TensorFlow ----------------------------


def run_child(tmp_path: Path, script: str) -> str:
    """``script`` after the child's own redirection of its output to ``train.log``."""
    log = tmp_path / "train.log"
    prelude = f"""
        import os, sys
        from pathlib import Path
        from workers import child
        child._redirect_output(Path({str(log)!r}))
    """
    code = textwrap.dedent(prelude) + textwrap.dedent(script)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False, timeout=60)
    return log.read_text()


def test_only_the_probe_lines_are_dropped_in_order_and_a_python_crash_keeps_its_traceback(
    tmp_path: Path,
) -> None:
    real_error = "E0000 00:00:1796287179.9 25930 op_kernel.cc:1] OOM when allocating tensor\n"
    out = run_child(
        tmp_path,
        f"""
        print("before", flush=True)
        with child._gpu_probe_filtered(True):
            os.write(2, {PROBE!r}.encode())
            print("stdout between", flush=True)
            os.write(2, {PROBE!r}.encode())
            # absl's note goes whatever follows it (oneDNN's notice, on a TensorFlow that
            # probes no GPU library); the line after it stays.
            os.write(2, {PROBE.splitlines(keepends=True)[0] + real_error!r}.encode())
            os.write(2, {CUINIT!r}.encode())
            os.write(2, b"a line in two ")
            os.write(2, b"writes\\n")
            print("a cuInit word in a sentence of our own", file=sys.stderr, flush=True)
            os.write(2, b"no newline at the end")
        print("\\nafter", flush=True)
        with child._gpu_probe_filtered(True):
            os.write(2, {PROBE + CUINIT!r}.encode())
            raise RuntimeError("the import failed")
        """,
    )
    assert out.splitlines() == [
        "before",
        "stdout between",
        real_error.strip(),
        "a line in two writes",
        "a cuInit word in a sentence of our own",
        "no newline at the end",
        "after",
        "Traceback (most recent call last):",
        *out.splitlines()[8:-1],
        "RuntimeError: the import failed",
    ], out


def test_the_probe_lines_stay_when_a_gpu_is_expected(tmp_path: Path) -> None:
    out = run_child(
        tmp_path,
        f"""
        with child._gpu_probe_filtered(False):
            os.write(2, {PROBE + CUINIT!r}.encode())
        """,
    )
    assert out == PROBE + CUINIT


@pytest.mark.keras
@pytest.mark.parametrize("gpu_ids", [[], [0]])
def test_the_child_filters_tensorflows_own_probe_only_without_gpus(
    tmp_path: Path, gpu_ids: list[int]
) -> None:
    """The real ``run`` and a real TensorFlow import on this GPU-less host (CUDA hidden, as
    for a CPU job); the trainer is a stand-in that lists the devices again."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    payload = {"job_id": 7, "attempt": 1, "job_dir": str(job_dir), "gpu_ids": gpu_ids}
    code = textwrap.dedent(
        f"""
        import json, sys, types
        from multiprocessing import Pipe

        def train(ctx):
            import tensorflow as tf
            print("devices", tf.config.list_physical_devices("GPU"), flush=True)
            return "succeeded"

        fake = types.ModuleType("workers.training")
        fake.train = train
        sys.modules["workers.training"] = fake
        from workers import child
        payload = json.loads({json.dumps({**payload, "spec": {}, "data_dir": str(tmp_path)})!r})
        reader, writer = Pipe(duplex=False)
        child.run(payload, writer)
        assert reader.recv()["status"] == "succeeded"
        """
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "-1", "TF_CPP_MIN_LOG_LEVEL": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=300)
    log = (job_dir / "train.log").read_text()
    assert done.returncode == 0, log
    assert "devices []" in log and log.endswith("halfway: child exiting\n"), log
    if gpu_ids:
        assert any("failed call to cuInit" in line for line in probe_noise_in(log)), log
    else:
        assert probe_noise_in(log) == [], log


# First start ----------------------------------------------------------------------------------


def run_until(args: list[str], ready: str, home: Path) -> list[str]:
    """Start ``halfway ARGS`` on a SQLite ``home``, stop it with Ctrl-C once a line contains
    ``ready``, and return everything it printed."""
    env = {k: v for k, v in os.environ.items() if k != "HALFWAY_DATABASE_URL"}
    env["HALFWAY_HOME"] = str(home)
    process = subprocess.Popen(
        [HALFWAY, *args],
        cwd=home.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    seen = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line.rstrip("\n"))
            if ready in line:
                seen.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert seen.wait(60), "\n".join(output)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        reader.join(timeout=10)
    return output


def test_first_start_says_one_line_per_migration_step_and_a_second_start_nothing(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    script = ScriptDirectory(str(Path(migrations.__file__).parent))
    steps = [(r.revision, r.doc) for r in reversed(list(script.walk_revisions()))]
    assert len(steps) >= 7

    first = run_until(["worker"], "started (gpus: none)", home)
    said = [line for line in first if "database" in line]
    assert len(said) == len(steps), first
    for line, (revision, doc) in zip(said, steps, strict=True):
        assert f"halfway.migrate: database upgraded to {revision} ({doc.split()[0]}" in line
    chatter = ("alembic", "Context impl", "non-transactional DDL", "Running upgrade")
    assert not [line for line in first if any(word in line for word in chatter)], first

    again = run_until(
        ["serve", "--no-worker", "--port", str(free_port())], "Application startup complete", home
    )
    assert not [line for line in again if "database" in line or "alembic" in line], again
