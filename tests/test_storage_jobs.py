"""Jobs on each store (a local directory and a real S3 API): a dataset uploaded through the
API, trained on by a real training child that stages on scratch and uploads, and its model,
log and TensorBoard files served back by the API out of the store."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.database.db import Database
from service.files.storage import Storage, open_storage
from service.settings import Settings
from tests.conftest import Api, Team
from tests.s3 import S3Server
from tests.test_training_keras import all_history
from workers.supervisor import Supervisor

pytestmark = pytest.mark.keras


@pytest.fixture
def store_api(storage_settings: Settings, db: Database, team: Team) -> Iterator[Api]:
    with TestClient(create_app(storage_settings, db, auth=True)) as c:
        yield Api(c, team.alice)


def npz_bytes(samples: int = 256, features: int = 8, classes: int = 3) -> bytes:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    np.savez(
        buffer,
        x_train=rng.normal(size=(samples, features)).astype(np.float32),
        y_train=rng.integers(0, classes, samples),
    )
    return buffer.getvalue()


def test_an_uploaded_dataset_trains_and_its_files_are_served_from_the_store(
    store_api: Api, db: Database, storage_settings: Settings, storage_kind: str
) -> None:
    api, settings = store_api, storage_settings
    storage = open_storage(settings.storage_config())
    up = api.post(
        "/v1/datasets",
        data={"name": "blobs"},
        files={"file": ("blobs.npz", npz_bytes(), "application/octet-stream")},
    )
    assert up.status_code == 201, up.text
    path = up.json()["path"]
    assert path == "uploads/alice/blobs.npz"
    assert storage.data.exists(path)
    listed = api.get("/v1/datasets").json()
    assert [(d["path"], d["bytes"]) for d in listed] == [(path, len(npz_bytes()))]
    again = api.post(
        "/v1/datasets",
        data={"name": "blobs"},
        files={"file": ("blobs.npz", npz_bytes(), "application/octet-stream")},
    )
    assert again.status_code == 409
    down = api.get(f"/v1/datasets/{path}")
    assert down.status_code == 200 and down.content == npz_bytes()
    for absent in ("uploads/alice/none.npz", "uploads/alice/../../x.npz", "uploads/a//b.npz"):
        assert api.get(f"/v1/datasets/{absent}").status_code == 404, absent
    refused = api.get("/v1/datasets/uploads/alice")
    assert refused.status_code == 422 and refused.json()["fields"][0]["field"].endswith("path")
    missing = api.post("/v1/jobs", json={"data": {"kind": "npz", "path": "uploads/x.npz"}})
    assert missing.status_code == 422 and missing.json()["fields"][0]["rule"] == "not_found"

    spec: dict[str, Any] = {
        "data": {"kind": "npz", "path": path},
        "model": {"input_size": 8, "hidden": [8], "num_classes": 3},
        "training": {
            "epochs": 3,
            "batch_size": 32,
            "steps_per_execution": 4,
            "checkpoint_every": 8,
        },
        "outputs": {"tensorboard": True},
    }
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    Supervisor(db, settings).run_once()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job["error"]
    assert [r["step"] for r in all_history(api, job_id)] == list(range(24))
    assert job["summary"]["checkpoint_step"] is not None

    names = {a["name"]: a["bytes"] for a in api.get(f"/v1/jobs/{job_id}/artifacts").json()}
    assert set(names) == {"model.keras", "train.log"}
    model = api.get(f"/v1/jobs/{job_id}/artifacts/model.keras")
    assert model.status_code == 200
    assert model.content == storage.artifacts.get_bytes(f"{job_id}/model.keras")
    assert len(model.content) == names["model.keras"]
    assert "config.json" in zipfile.ZipFile(io.BytesIO(model.content)).namelist()
    log = api.get(f"/v1/jobs/{job_id}/logs").text
    assert f"halfway: job {job_id} attempt 1 starting" in log
    assert "halfway: child exiting" in log
    keys = [e.key for e in storage.artifacts.list(f"{job_id}/")]
    assert any(k.startswith(f"{job_id}/tensorboard/") and "tfevents" in k for k in keys), keys
    # A finished job keeps no checkpoint, committed or not.
    assert not [k for k in keys if "checkpoint-" in k], keys
    if storage_kind == "s3":
        # Nothing landed on the local artifact or data directories, and scratch was cleaned.
        assert not any(settings.resolved_artifact_dir().iterdir())
        assert not list(settings.resolved_data_dir().rglob("*.npz"))
        assert not list((settings.resolved_scratch_dir() / "jobs").iterdir())


def test_an_unreachable_store_is_a_503_not_a_500(
    settings: Settings, db: Database, team: Team, s3_server: S3Server
) -> None:
    """With credentials (the S3 server's fixture sets them), so the failure is the address."""
    from tests.live import free_port

    down = settings.model_copy(
        update={
            "storage_url": "s3://nowhere/team",
            "s3_endpoint_url": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        }
    )
    with TestClient(create_app(down, db, auth=True)) as c:
        api = Api(c, team.alice)
        job_id = api.post("/v1/jobs", json={}).json()["id"]
        for url in (f"/v1/jobs/{job_id}/logs", f"/v1/jobs/{job_id}/artifacts", "/v1/datasets"):
            r = api.get(url)
            assert r.status_code == 503, (url, r.text)
            assert r.json()["error"] == "storage_unavailable"


def _train(
    spec: dict[str, Any],
    storage: Storage,
    scratch: Path,
    *,
    stop_after: int | None,
    resume: int | None,
) -> Any:
    """One attempt as a host runs it: staged into fresh scratch, trained (in this process),
    each checkpoint committed from scratch when the child says it wrote it."""
    import threading

    from tests.training_runs import Run
    from workers import staging
    from workers.context import RunContext
    from workers.training import train

    files = staging.JobFiles.for_attempt(storage, 1, 1, scratch)
    staged = staging.stage(
        storage, spec, files, resume_step=resume, data_cache=scratch / "data", code_cache=scratch
    )
    stop = threading.Event()
    run = Run(status=None, error=None)

    def emit(message: Any) -> None:
        run.messages.append(message)
        if message["type"] == "checkpoint":
            files.commit_checkpoint(message["step"])
        last = message["records"][-1][0] if message["type"] == "steps" else -1
        if stop_after is not None and last >= stop_after:
            stop.set()

    ctx = RunContext(
        job_id=1,
        spec=spec,
        job_dir=staged.scratch,
        data_dir=staged.data,
        emit=emit,
        stop=stop,
        flush_seconds=0.0,
        resume_step=staged.resume_step,
    )
    run.status = train(ctx)
    return run


def test_a_resumed_attempt_on_fresh_disk_uses_only_a_committed_checkpoint(
    storage: Storage, tmp_path: Path
) -> None:
    """A new host (empty scratch) resumes from the store's checkpoint; the same checkpoint
    without its marker (an upload cut short) is not resumed from: the attempt starts over."""
    from tests.training_runs import job_spec
    from workers import checkpoints

    spec = job_spec(tmp_path, training={"epochs": 4})
    first = _train(spec, storage, tmp_path / "host-a", stop_after=30, resume=None)
    assert first.status == "cancelled"
    step = first.of_type("checkpoint")[-1]["step"]
    assert 30 <= step < 92 and checkpoints.committed_steps(storage.artifacts, "1") == [step]

    resumed = _train(spec, storage, tmp_path / "host-b", stop_after=None, resume=step)
    assert resumed.status == "succeeded"
    assert resumed.started["start_step"] == step and resumed.steps == list(range(step, 92))

    storage.artifacts.delete(checkpoints.marker_key("1", step))
    over = _train(spec, storage, tmp_path / "host-c", stop_after=None, resume=step)
    assert over.started["start_step"] == 0 and over.steps == list(range(92))
