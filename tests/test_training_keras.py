"""Real Keras on the CPU: jobs submitted through the API, run by the supervisor in a spawned
training child, read back through the API. Tiny models, but the real code paths."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.database.db import Database
from service.settings import Settings
from service.specs.policies import POLICIES
from tests.conftest import Api
from tests.reference import expected_scales
from workers.supervisor import Supervisor

pytestmark = pytest.mark.keras

SMALL: dict[str, dict[str, Any]] = {
    "data": {"kind": "synthetic", "samples": 640, "features": 32, "classes": 4},
    "model": {"input_size": 32, "hidden": [16], "num_classes": 4},
    "training": {"epochs": 3, "batch_size": 32, "steps_per_execution": 7},
}


def spec(**overrides: Any) -> dict[str, Any]:
    out: dict[str, Any] = {k: dict(v) for k, v in SMALL.items()}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def submit(api: Api, body: dict[str, Any]) -> int:
    r = api.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


def all_history(api: Api, job_id: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    after = -1
    while True:
        page = api.get(f"/v1/jobs/{job_id}/history?after_step={after}&limit=10000").json()
        rows += page["items"]
        after = page["next_after_step"]
        if not page["has_more"]:
            return rows


def test_overflow_steps_are_skipped_and_halve_the_scale_and_clean_steps_double_it(
    api: Api, db: Database, settings: Settings
) -> None:
    faults = [5, 30, 31]
    job_id = submit(
        api,
        spec(
            loss_scale={"initial_scale": 1024, "growth_steps": 10},
            faults={"nonfinite_at_steps": faults},
        ),
    )
    assert Supervisor(db, settings).run_once()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job["error"]
    rows = all_history(api, job_id)
    total = 3 * 20
    assert [r["step"] for r in rows] == list(range(total))  # every step, no gap
    assert [r["epoch"] for r in rows] == [s // 20 for s in range(total)]
    finite = [r["finite"] for r in rows]
    assert [s for s, ok in enumerate(finite) if not ok] == faults
    scales = [r["loss_scale"] for r in rows]
    assert scales == expected_scales(finite, initial=1024, growth_steps=10)
    # Spelled out: halved right after each overflow, doubled after 10 clean steps.
    assert scales[5] == 1024 and scales[6] == 512 and scales[16] == 1024
    assert scales[31] == scales[30] / 2 and scales[32] == scales[30] / 4
    # The skipped steps applied no update.
    assert job["summary"]["metrics"]["timing"]["updates_applied"] == total - len(faults)
    assert job["summary"]["overflow_count"] == 3
    assert job["summary"]["last_step"] == total - 1
    assert job["progress"]["fraction"] == 1.0
    assert all(r["loss"] is not None and r["loss"] > 0 for r in rows)
    # Synthetic data is learnable: the loss falls.
    assert np.mean([r["loss"] for r in rows[-10:]]) < np.mean([r["loss"] for r in rows[:10]])
    assert (settings.resolved_artifact_dir() / str(job_id) / "model.keras").is_file()
    assert "starting" in (settings.resolved_artifact_dir() / str(job_id) / "train.log").read_text()


def test_precision_report_shows_float16_dense_and_float32_softmax(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = submit(api, spec(training={"epochs": 1}))
    Supervisor(db, settings).run_once()
    with db.read() as s:
        from service.database.models import Job

        job = s.get(Job, job_id)
        assert job is not None
        report = {row["layer"]: row for row in job.precision_report}
    assert report["dense_0"]["output_dtype"] == "float16"
    assert report["dense_0"]["variable_dtype"] == "float32"
    assert report["predictions"]["output_dtype"] == "float32"


def test_cancelled_running_job_ends_cancelled_with_its_history(
    api: Api, db: Database, settings: Settings
) -> None:
    body = spec(
        data={"samples": 4096},
        training={"epochs": 1000, "batch_size": 32, "steps_per_execution": 4},
    )
    job_id = submit(api, body)
    sup = Supervisor(db, settings)
    thread = threading.Thread(target=sup.run_once)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (api.get(f"/v1/jobs/{job_id}").json()["summary"]["last_step"] or 0) >= 50:
            break
        time.sleep(0.2)
    r = api.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 202
    thread.join(timeout=120)
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "cancelled"
    rows = all_history(api, job_id)
    assert len(rows) >= 50
    assert [r["step"] for r in rows] == list(range(len(rows)))
    assert job["summary"]["last_step"] == len(rows) - 1


def test_crashing_child_ends_failed_with_its_reason(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = submit(api, spec(faults={"crash_at_step": 12}, max_attempts=1))
    Supervisor(db, settings).run_once()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "failed"
    assert "RuntimeError: injected crash at step 12" in job["error"]
    assert job["summary"]["last_step"] >= 12


def test_npz_with_mismatched_shapes_fails_without_retry(
    api: Api, db: Database, settings: Settings
) -> None:
    path = settings.resolved_data_dir() / "bad.npz"
    np.savez(path, x_train=np.zeros((10, 32), np.float32), y_train=np.zeros((9,), np.int64))
    job_id = submit(api, {**spec(), "data": {"kind": "npz", "path": "bad.npz"}})
    Supervisor(db, settings).run_once()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "failed" and job["attempt"] == 1
    assert "x_train has 10 samples but y_train has 9" in job["error"]


def test_npz_with_validation_split_trains_and_reports_val_metrics(
    api: Api, db: Database, settings: Settings
) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 8)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    np.savez(
        settings.resolved_data_dir() / "ok.npz",
        x_train=x[:160],
        y_train=y[:160],
        x_val=x[160:],
        y_val=y[160:],
    )
    job_id = submit(
        api,
        {
            "data": {"kind": "npz", "path": "ok.npz"},
            "model": {"input_size": 8, "hidden": [8], "num_classes": 2},
            "training": {"epochs": 2, "batch_size": 16},
            "precision": {"policy": "float32"},
        },
    )
    Supervisor(db, settings).run_once()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job["error"]
    assert "val_loss" in job["summary"]["metrics"]["last_epoch"]
    assert job["summary"]["loss_scale"] == 1.0  # float32: no scaling, recorded as 1
    assert len(all_history(api, job_id)) == 20


def test_keras_dataset_from_the_local_cache(
    api: Api, db: Database, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "keras" / "datasets"
    cache.mkdir(parents=True)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(96, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, size=(96,), dtype=np.uint8)
    np.savez(cache / "mnist.npz", x_train=x, y_train=y, x_test=x[:10], y_test=y[:10])
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras"))  # inherited by the spawned child
    job_id = submit(api, {"data": {"kind": "keras", "name": "mnist"}, "training": {"epochs": 1}})
    Supervisor(db, settings).run_once()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job["error"]
    assert len(all_history(api, job_id)) == 3  # 96 samples / batch 32


def test_keras_dataset_missing_and_offline_is_a_clear_job_error(
    api: Api, db: Database, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "empty-keras"))
    # Nothing can be downloaded: point the proxy at a closed port so the test never depends
    # on this machine's network.
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")
    job_id = submit(
        api,
        {
            "data": {"kind": "keras", "name": "fashion_mnist"},
            "training": {"epochs": 1},
            "max_attempts": 1,
        },
    )
    Supervisor(db, settings).run_once()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "failed"
    assert "not in the Keras cache" in job["error"] and "could not be downloaded" in job["error"]


def test_policy_table_matches_keras() -> None:
    import keras

    for name, facts in POLICIES.items():
        policy = keras.mixed_precision.Policy(name)
        assert (policy.variable_dtype, policy.compute_dtype) == (
            facts.variable_dtype,
            facts.compute_dtype,
        ), name


def test_mirrored_strategy_on_two_logical_cpus_records_the_same_history(
    api: Api, db: Database, settings: Settings
) -> None:
    """A job with resources.cpu_replicas=2 trains under MirroredStrategy (the multi-GPU path)
    and records exactly what the single-device run of the same spec records: the global batch
    loss, the scale each step used, overflows on every replica."""
    body = spec(
        faults={"nonfinite_at_steps": [4, 17]},
        loss_scale={"initial_scale": 256, "growth_steps": 6},
        training={"epochs": 2, "steps_per_execution": 5},
    )
    single = submit(api, body)
    mirrored = submit(api, {**body, "resources": {"gpus": 0, "cpu_replicas": 2}})
    sup = Supervisor(db, settings)
    assert sup.run_once() and sup.run_once()
    jobs = {j: api.get(f"/v1/jobs/{j}").json() for j in (single, mirrored)}
    assert all(j["status"] == "succeeded" for j in jobs.values()), [
        (j["status"], j["error"], j["attempt_errors"]) for j in jobs.values()
    ]
    with db.read() as s:
        from service.database.models import Job

        device = s.get(Job, mirrored).device  # type: ignore[union-attr]
    assert device["replicas"] == 2
    a, b = all_history(api, single), all_history(api, mirrored)
    assert [r["step"] for r in b] == list(range(40))
    assert [r["finite"] for r in b] == [r["finite"] for r in a]
    assert [s for s, r in enumerate(b) if not r["finite"]] == [4, 17]
    assert [r["loss_scale"] for r in b] == [r["loss_scale"] for r in a]
    # Same global batches, same initial weights: the whole-batch loss matches (up to the order
    # float16 sums run in across two devices).
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=0.05)
