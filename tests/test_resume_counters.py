"""A resumed attempt goes on where the interrupted one stopped, not only in its weights: the
guards' runs, the target-loss window and the time since the first attempt started come from
the checkpoint, so a job that crashed once ends as the same job uninterrupted would. A
missing checkpoint is a restart from step 0 that the job says it made. Real Keras, real
training processes (the supervisor's spawned children), both databases."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from service.database.db import Database
from service.settings import Settings
from tests.conftest import Api
from tests.test_supervisor import load
from tests.test_training_keras import all_history, submit
from workers.supervisor import Supervisor

pytestmark = pytest.mark.keras

DATA = {"kind": "synthetic", "samples": 3200, "features": 32, "classes": 4}
MODEL = {"input_size": 32, "hidden": [16], "num_classes": 4}


def spec(training: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "data": DATA,
        "model": MODEL,
        "training": {"epochs": 4, "batch_size": 32, "steps_per_execution": 5, **training},
        **more,
    }


def crash_once_after(step: int) -> dict[str, Any]:
    """Crash the first attempt at ``step``; the resumed attempt runs through it."""
    return {"crash_at_step": step, "crash_attempts": [1]}


def finished(api: Api, job_id: int, timeout: float = 240) -> dict[str, Any]:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = api.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish")


def test_a_guard_run_that_spans_the_checkpoint_trips_at_the_same_step_after_a_resume(
    api: Api, worker: Supervisor
) -> None:
    # Steps 47..53 overflow; five in a row fail the job: at step 51. The checkpoint at 50
    # holds a run of three, and the first attempt crashes at step 51 before counting it.
    faults = {"nonfinite_at_steps": list(range(47, 54))}
    guards = {"max_consecutive_nonfinite": 5}
    body = spec({"checkpoint_every": 50}, guards=guards)
    straight = finished(api, submit(api, {**body, "faults": faults}))
    resumed = finished(api, submit(api, {**body, "faults": {**faults, **crash_once_after(51)}}))

    assert straight["status"] == "failed" and "up to step 51" in straight["error"]
    assert resumed["attempt"] == 2, resumed["attempt_errors"]
    assert "injected crash at step 51" in resumed["attempt_errors"][0]["error"]
    assert (resumed["status"], resumed["error"]) == (straight["status"], straight["error"])
    assert all_history(api, resumed["id"]) == all_history(api, straight["id"])


def test_step_and_time_to_target_carry_across_a_resume(api: Api, worker: Supervisor) -> None:
    straight = finished(api, submit(api, spec({"target_loss": 1.0})))
    assert straight["status"] == "succeeded", straight["error"]
    target_step = int(straight["summary"]["metrics"]["timing"]["step_to_target"])
    # A checkpoint a few steps before the target (the window of 50 losses is full there),
    # and a crash right after it: the resumed attempt reaches the target 10-15 steps in.
    cut = (target_step - 10) // 5 * 5
    assert cut >= 60, target_step
    body = spec({"target_loss": 1.0, "checkpoint_every": cut}, faults=crash_once_after(cut + 1))
    resumed = finished(api, submit(api, body))
    assert resumed["status"] == "succeeded", resumed["error"]
    assert resumed["attempt"] == 2, resumed["attempt_errors"]

    # The resumed job trained exactly as the uninterrupted one...
    assert [r["loss"] for r in all_history(api, resumed["id"])] == [
        r["loss"] for r in all_history(api, straight["id"])
    ]
    timing = resumed["summary"]["metrics"]["timing"]
    # ...so it reached the target at the same step, and its time runs from the first
    # attempt's start: it includes the crash and the second start (a process importing
    # TensorFlow), which the uninterrupted job never paid.
    assert int(timing["step_to_target"]) == target_step
    seconds = straight["summary"]["metrics"]["timing"]["time_to_target_seconds"]
    assert timing["time_to_target_seconds"] > seconds


def test_a_missing_checkpoint_restarts_from_step_0_and_the_job_says_so(
    api: Api, db: Database, settings: Settings
) -> None:
    body = spec({"epochs": 2, "checkpoint_every": 100}, faults=crash_once_after(101))
    job_id = submit(api, body)
    supervisor = Supervisor(db, settings)

    def attempt() -> None:
        thread = threading.Thread(target=supervisor.run_once)
        thread.start()
        thread.join(timeout=240)
        assert not thread.is_alive()

    attempt()
    crashed = load(db, job_id)
    assert (crashed.status, crashed.attempt, crashed.checkpoint_step) == ("queued", 1, 100)
    job_dir = settings.resolved_artifact_dir() / str(job_id)
    lost = sorted(job_dir.glob("checkpoint-*.npz"))
    assert lost, "the first attempt left its checkpoint"
    for path in lost:
        path.unlink()
    attempt()

    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job["error"]
    assert job["attempt"] == 2
    first, second = job["attempt_errors"]
    assert first["attempt"] == 1 and "injected crash at step 101" in first["error"]
    assert second["attempt"] == 2
    assert "checkpoint of step 100 was missing" in second["error"]
    assert "restarted from step 0" in second["error"]
    assert second["error"] in job["notes"]
    total = job["progress"]["total_steps"]
    assert [r["step"] for r in all_history(api, job_id)] == list(range(total))
