"""Two hosts with nothing shared but PostgreSQL (or SQLite here) and the object store: two
``halfway worker`` processes with their own HALFWAY_HOME (no common path), a real S3 API.
The first is SIGKILLed mid-job; the second reclaims the job and resumes from the checkpoint
it finds in the store, with no gap and no duplicate step."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.database.db import Database
from service.files.storage import open_storage
from service.settings import Settings
from tests.conftest import Api, Team
from tests.reference import expected_scales
from tests.s3 import S3Server
from tests.test_crash_recovery import HALFWAY, alive, children, wait_until
from tests.test_training_keras import all_history
from workers import checkpoints

pytestmark = pytest.mark.keras


@pytest.fixture
def s3_settings(settings: Settings, s3_server: S3Server) -> Settings:
    return settings.model_copy(
        update={
            "storage_url": f"s3://{s3_server.new_bucket()}/team",
            "s3_endpoint_url": s3_server.endpoint,
        }
    )


@pytest.fixture
def s3_api(s3_settings: Settings, db: Database, team: Team) -> Iterator[Api]:
    with TestClient(create_app(s3_settings, db, auth=True)) as c:
        yield Api(c, team.alice)


def saved_models(home: Path) -> list[Path]:
    """Saved Keras models under a host's folder. Not the ``.keras`` folder Keras makes in its
    home on import: a sandboxed child's home is its scratch (``/job``), so a killed child's
    scratch holds one (its ``keras.json``)."""
    return [p for p in home.rglob("*.keras") if p.is_file()]


def start_host(
    home: Path, settings: Settings, server: S3Server, log: Path
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HALFWAY_", "AWS_"))} | {
        **server.env(),
        "HALFWAY_HOME": str(home),
        "HALFWAY_DATABASE_URL": settings.resolved_database_url(),
        "HALFWAY_STORAGE_URL": str(settings.storage_url),
        "HALFWAY_LEASE_SECONDS": "3",
        "HALFWAY_POLL_SECONDS": "0.2",
        "HALFWAY_HISTORY_FLUSH_SECONDS": "0.2",
    }
    home.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [HALFWAY, "worker"], env=env, cwd=home, stdout=log.open("ab"), stderr=subprocess.STDOUT
    )


def test_a_job_killed_on_one_host_resumes_on_another_from_the_stores_checkpoint(
    s3_api: Api, s3_settings: Settings, s3_server: S3Server, tmp_path: Path
) -> None:
    api, settings = s3_api, s3_settings
    store = open_storage(settings.storage_config()).artifacts
    spec = {
        "data": {"samples": 3200, "features": 16, "classes": 4},
        "model": {"input_size": 16, "hidden": [16], "num_classes": 4},
        "training": {
            "epochs": 20,
            "batch_size": 32,
            "steps_per_execution": 10,
            "checkpoint_every": 200,
        },
        "loss_scale": {"growth_steps": 150},
        # Host A's attempt stops at step 905, past the checkpoint awaited below, so the
        # SIGKILL lands while it still runs however fast the machine is.
        "faults": {
            "nonfinite_at_steps": [30, 700, 701, 1500],
            "hang_at_step": 905,
            "crash_attempts": [1],
        },
    }
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    total = 20 * 100
    host_a, host_b = tmp_path / "host-a", tmp_path / "host-b"
    log = tmp_path / "hosts.log"

    first = start_host(host_a, settings, s3_server, log)
    try:
        wait_until(
            lambda: (
                (api.get(f"/v1/jobs/{job_id}").json()["summary"]["checkpoint_step"] or 0) >= 400
            ),
            240,
            "a checkpoint acknowledged",
        )
        trainers = children(first.pid)
        assert trainers, "host A's worker should have a training child"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        wait_until(lambda: not any(alive(p) for p in trainers), 30, "host A's child to die")
    finally:
        if first.poll() is None:
            first.kill()
    killed_at = api.get(f"/v1/jobs/{job_id}").json()
    assert killed_at["status"] == "running" and killed_at["attempt"] == 1
    acknowledged = killed_at["summary"]["checkpoint_step"]
    # The checkpoint host B will need is in the store, committed; host B has no disk yet.
    assert acknowledged in checkpoints.committed_steps(store, str(job_id))
    assert not host_b.exists()

    second = start_host(host_b, settings, s3_server, log)
    try:
        wait_until(
            lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] not in ("queued", "running"),
            300,
            "the job to finish on host B",
        )
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=60)
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", (job["error"] or "") + log.read_text()[-3000:]
    assert job["attempt"] == 2
    rows = all_history(api, job_id)
    assert [r["step"] for r in rows] == list(range(total))
    assert {30, 700, 701, 1500} <= {r["step"] for r in rows if not r["finite"]}
    # Resumed from the checkpoint (its loss-scale state included), not started over.
    assert [r["loss_scale"] for r in rows] == expected_scales(
        [r["finite"] for r in rows], growth_steps=150
    )
    text = api.get(f"/v1/jobs/{job_id}/logs", params={"offset": 0}).text
    assert f"job {job_id} attempt 2 starting" in text
    assert f"job {job_id} attempt 1 starting" in text  # host A's part of the log, from the store
    assert "missing; starting over" not in text
    assert store.exists(f"{job_id}/model.keras")
    # The host that finished the job kept none of its files: they live in the store.
    assert not saved_models(host_b), host_b
    assert not list(host_b.rglob("checkpoint-*.npz")), host_b
    # Host A kept no committed checkpoint either. SIGKILLed, it can leave behind those not
    # yet uploaded (newer than any acknowledged; the child does not wait for its host, so on
    # a loaded machine there can be several): nothing removes a killed child's scratch
    # (docs/hosts.md).
    assert not saved_models(host_a), host_a
    left = list(host_a.rglob("checkpoint-*.npz"))
    for path in left:
        assert int(path.stem.rsplit("-", 1)[1]) > acknowledged, path
