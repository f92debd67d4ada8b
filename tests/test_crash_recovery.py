"""A worker killed with SIGKILL mid-job: its training child dies with it, the lease expires,
another worker reclaims the job (attempt 2), resumes from the checkpoint and completes it
with exactly one history row per step. Real processes, real Keras, both databases."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from service.database.db import Database
from service.database.models import Job
from service.settings import Settings
from tests.conftest import Api
from tests.test_training_keras import all_history

pytestmark = pytest.mark.keras

HALFWAY = str(Path(sys.executable).parent / "halfway")


def start_worker(settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "HALFWAY_HOME": str(settings.home),
        "HALFWAY_DATABASE_URL": settings.resolved_database_url(),
        "HALFWAY_LEASE_SECONDS": "3",
        "HALFWAY_POLL_SECONDS": "0.2",
        "HALFWAY_HISTORY_FLUSH_SECONDS": "0.2",
    }
    out = log.open("ab")
    return subprocess.Popen([HALFWAY, "worker"], env=env, stdout=out, stderr=subprocess.STDOUT)


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found |= {int(c) for c in text}
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def rows_past_the_checkpoint(settings: Settings, job_id: int) -> bool:
    """Whether the killed attempt stored rows from its acknowledged checkpoint on (which the
    resume must cut), read from the database: through the API the job may be a poll-cache
    snapshot taken before the attempt's last flush."""
    db = Database.connect(settings.resolved_database_url())
    try:
        with db.read() as s:
            job = s.get(Job, job_id)
            assert job is not None
            return (job.last_step if job.last_step is not None else -1) >= (
                job.checkpoint_step or 0
            )
    finally:
        db.dispose()


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def all_gradients(get: Any, job_id: int) -> tuple[list[dict[str, Any]], set[int]]:
    """Every gradient sample of a job, page by page, and the history versions the pages
    carried (one, unless a resume rewrote the history meanwhile)."""
    samples: list[dict[str, Any]] = []
    versions: set[int] = set()
    after = -1
    while True:
        page = get(f"/v1/jobs/{job_id}/gradients?after_step={after}&limit=7")
        samples += page["samples"]
        versions.add(page["history_version"])
        if page["next_after_step"] is None:
            return samples, versions
        after = page["next_after_step"]


def check_gradients_across_resume(
    get: Any, job_id: int, total: int, every: int, shadow_every: int, cut: bool
) -> None:
    """One sample per sampled step, in order, across the resume; the shadow's on its steps;
    the pages carry the history's version, which moved if the resume cut stored rows."""
    samples, versions = all_gradients(get, job_id)
    assert [s["step"] for s in samples] == list(range(0, total, every))
    assert [s["shadow"] for s in samples] == [s["step"] % shadow_every == 0 for s in samples]
    assert all(s["lost_share"] is not None for s in samples if s["shadow"])
    assert all(s["variables"] and s["zero_share"] is not None for s in samples)
    history_version = get(f"/v1/jobs/{job_id}/history?limit=1")["history_version"]
    assert versions == {history_version}
    assert history_version >= 1 if cut else history_version == 0
    latest = get(f"/v1/jobs/{job_id}")["gradients"]["latest"]
    assert latest["step"] == samples[-1]["step"]


def test_sigkilled_worker_job_resumes_from_checkpoint_with_no_gap_and_no_duplicate(
    api: Api, settings: Settings, tmp_path: Path
) -> None:
    spec = {
        "data": {"samples": 3200, "features": 16, "classes": 4},
        "model": {"input_size": 16, "hidden": [16], "num_classes": 4},
        "training": {
            "epochs": 40,
            "batch_size": 32,
            "steps_per_execution": 10,
            "checkpoint_every": 200,
        },
        "loss_scale": {"growth_steps": 150},
        "faults": {"nonfinite_at_steps": [30, 700, 701, 2500]},
        "gradients": {"every": 100, "shadow_every": 400},
    }
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    total = 40 * 100
    log = tmp_path / "workers.log"
    first = start_worker(settings, log)
    try:
        wait_until(
            lambda: (
                (api.get(f"/v1/jobs/{job_id}").json()["summary"]["checkpoint_step"] or 0) >= 400
            ),
            240,
            "a checkpoint",
        )
        trainers = children(first.pid)
        assert trainers, "the worker should have a training child"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        # PR_SET_PDEATHSIG: the orphaned child must not keep training.
        wait_until(lambda: not any(alive(p) for p in trainers), 30, "the orphan to die")
    finally:
        if first.poll() is None:
            first.kill()
    killed_at = api.get(f"/v1/jobs/{job_id}").json()
    assert killed_at["status"] == "running" and killed_at["attempt"] == 1
    checkpoint = killed_at["summary"]["checkpoint_step"]
    cut = rows_past_the_checkpoint(settings, job_id)  # rows the resume must rewrite

    second = start_worker(settings, log)
    try:
        wait_until(
            lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] not in ("queued", "running"),
            300,
            "the job to finish",
        )
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=60)
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job["error"] + log.read_text()[-3000:]
    assert job["attempt"] == 2
    rows = all_history(api, job_id)
    assert [r["step"] for r in rows] == list(range(total))
    overflows = [r["step"] for r in rows if not r["finite"]]
    # The injected ones, plus the natural overflows of float16 once the scale has grown.
    assert {30, 700, 701, 2500} <= set(overflows)
    assert job["summary"]["overflow_count"] == len(overflows)
    assert job["summary"]["last_step"] == total - 1
    # The resumed attempt continued the loss-scale sequence from the checkpoint rather than
    # starting again at the initial scale.
    from tests.reference import expected_scales

    assert [r["loss_scale"] for r in rows] == expected_scales(
        [r["finite"] for r in rows], growth_steps=150
    )
    assert checkpoint >= 400
    check_gradients_across_resume(
        lambda path: api.get(path).json(), job_id, total, every=100, shadow_every=400, cut=cut
    )
