"""Per-epoch metrics: the store (idempotent on ``(job_id, epoch)``, NaN and infinity stored as
null, cut with the history on a resume from the epoch the resumed attempt restarts in), the
supervisor's flush writing each epoch the child reports, ``GET /v1/jobs/{id}/metrics`` with
its 401 and 404, ``Client.metrics``, and a real Keras job that crashes mid-run and resumes
from its checkpoint, ending with one row per epoch. SQLite and PostgreSQL."""

from __future__ import annotations

import math
from typing import Any

import pytest

from service.client import Client
from service.client.errors import NotFound
from service.database.db import Database
from service.database.models import Job, utcnow
from service.recording import epochmetrics, history
from service.recording.records import StepRecord
from service.settings import Settings
from tests import fakes
from tests.conftest import Api, Team
from tests.live import Live
from tests.test_history_queries import submit
from tests.test_resume_counters import crash_once_after, finished
from tests.test_supervisor import make_job
from tests.test_training_keras import all_history
from tests.test_training_keras import submit as submit_spec
from workers.supervisor import Supervisor


def store(db: Database, job_id: int, epochs: dict[int, dict[str, Any]]) -> None:
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        cleaned = [epochmetrics.clean_epoch(e, m) for e, m in epochs.items()]
        epochmetrics.write_epochs(s, job, cleaned)


def stored(db: Database, job_id: int) -> dict[int, dict[str, Any]]:
    with db.read() as s:
        return {e["epoch"]: e["metrics"] for e in epochmetrics.read_epochs(s, job_id)}


def with_steps(db: Database, job_id: int, *, epochs: int, per_epoch: int) -> None:
    """The job ran ``epochs`` epochs of ``per_epoch`` steps, and reported each one."""
    rows = [StepRecord(s, s // per_epoch, 1.0, 1024.0, True) for s in range(epochs * per_epoch)]
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.steps_per_epoch = per_epoch
        history.write_steps(s, job, rows, now=utcnow())
    store(db, job_id, {e: {"loss": 1.0 / (e + 1), "val_loss": 2.0} for e in range(epochs)})


def cut(db: Database, job_id: int, step: int) -> None:
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        history.truncate_after(s, job, step)


# --------------------------------------------------------------------------------------------
# The store


def test_epochs_are_read_in_order_with_non_finite_values_as_null(api: Api, db: Database) -> None:
    job_id = submit(api)
    store(db, job_id, {2: {"loss": 0.5}, 0: {"loss": math.nan, "accuracy": 0.25}})
    store(db, job_id, {1: {"loss": math.inf, "accuracy": -math.inf, "note": "not a number"}})
    assert stored(db, job_id) == {
        0: {"loss": None, "accuracy": 0.25},
        1: {"loss": None, "accuracy": None, "note": None},
        2: {"loss": 0.5},
    }
    assert list(stored(db, job_id)) == [0, 1, 2]


def test_a_resent_epoch_leaves_one_row_with_the_last_values(api: Api, db: Database) -> None:
    job_id = submit(api)
    store(db, job_id, {0: {"loss": 0.5}, 1: {"loss": 0.25}})
    store(db, job_id, {1: {"loss": 0.25}})
    store(db, job_id, {1: {"loss": 0.125, "val_loss": 0.5}})
    assert stored(db, job_id) == {0: {"loss": 0.5}, 1: {"loss": 0.125, "val_loss": 0.5}}


@pytest.mark.parametrize(
    ("resume_step", "left"),
    [(25, [0, 1]), (20, [0, 1]), (19, [0]), (0, []), (40, [0, 1, 2, 3])],
    ids=["mid-epoch", "epoch-boundary", "last-step-of-an-epoch", "from-scratch", "past-the-end"],
)
def test_a_resume_forgets_the_epoch_it_restarts_in_and_every_later_one(
    api: Api, db: Database, resume_step: int, left: list[int]
) -> None:
    job_id = submit(api)
    with_steps(db, job_id, epochs=4, per_epoch=10)
    cut(db, job_id, resume_step)
    assert list(stored(db, job_id)) == left
    # The resumed attempt reports its epochs again: one row each, with its values.
    again = {e: {"loss": 9.0 + e} for e in range(resume_step // 10, 4)}
    store(db, job_id, again)
    after = stored(db, job_id)
    assert list(after) == [0, 1, 2, 3]
    for epoch in range(4):
        expected = again.get(epoch, {"loss": 1.0 / (epoch + 1), "val_loss": 2.0})
        assert after[epoch] == expected


def test_a_removed_job_takes_its_epochs_along(api: Api, db: Database) -> None:
    job_id = submit(api)
    store(db, job_id, {0: {"loss": 0.5}})
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.delete(job)
    assert stored(db, job_id) == {}


# --------------------------------------------------------------------------------------------
# The supervisor writes what the child reports


def test_the_supervisor_stores_each_epoch_the_child_reports(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = make_job(db, {"mode": "succeed", "steps": 8})
    assert Supervisor(db, settings, trainer=fakes.trainer).run_once()
    assert stored(db, job_id) == {0: {"loss": 0.5}}
    body = api.get(f"/v1/jobs/{job_id}/metrics").json()
    assert body == {"job_id": job_id, "epochs": [{"epoch": 0, "metrics": {"loss": 0.5}}]}
    # The job keeps the last epoch too, as before.
    assert api.get(f"/v1/jobs/{job_id}").json()["summary"]["metrics"]["last_epoch"] == {
        "epoch": 0,
        "loss": 0.5,
    }


# --------------------------------------------------------------------------------------------
# The endpoint


def test_the_endpoint_answers_every_member_and_refuses_without_a_token_or_a_job(
    api: Api, db: Database, team: Team
) -> None:
    job_id = submit(api)  # alice's
    store(db, job_id, {1: {"loss": 0.25, "val_loss": math.nan}, 0: {"loss": 0.5}})
    # Read as the history is: any user may, not only the owner.
    r = api.as_user(team.bob).get(f"/v1/jobs/{job_id}/metrics")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "job_id": job_id,
        "epochs": [
            {"epoch": 0, "metrics": {"loss": 0.5}},
            {"epoch": 1, "metrics": {"loss": 0.25, "val_loss": None}},
        ],
    }
    again = api.get(f"/v1/jobs/{job_id}/metrics", headers={"If-None-Match": r.headers["ETag"]})
    assert again.status_code == 304
    assert api.as_user(None).get(f"/v1/jobs/{job_id}/metrics").status_code == 401
    missing = api.get(f"/v1/jobs/{job_id + 1000}/metrics")
    assert missing.status_code == 404
    assert missing.json()["error"] == "not_found"
    assert api.get("/v1/jobs/0/metrics").status_code == 422
    # A job without an ended epoch has none.
    other = submit(api)
    assert api.get(f"/v1/jobs/{other}/metrics").json() == {"job_id": other, "epochs": []}


def test_the_client_gives_a_row_per_epoch_and_a_column_per_metric(live: Live) -> None:
    job_id = live.submit({})
    store(live.db, job_id, {0: {"loss": 0.5, "accuracy": 0.5}, 1: {"loss": 0.25, "val_loss": 1}})
    client = Client(live.url, live.team.bob)
    frame = client.metrics(job_id)
    assert list(frame.index) == [0, 1] and frame.index.name == "epoch"
    assert list(frame.columns) == ["loss", "accuracy", "val_loss"]
    assert frame["loss"].tolist() == [0.5, 0.25]
    assert str(frame["val_loss"].dtype) == "float64"
    assert frame["val_loss"].isna().tolist() == [True, False]
    assert frame["accuracy"].isna().tolist() == [False, True]
    with pytest.raises(NotFound):
        client.metrics(job_id + 1000)


# --------------------------------------------------------------------------------------------
# Real Keras: a crash mid-run and a resume from the checkpoint


@pytest.mark.keras
def test_a_resumed_keras_job_has_one_row_per_epoch_with_the_resumed_runs_values(
    api: Api, worker: Supervisor
) -> None:
    # 160 training examples of 200 (validation_split 0.2), batches of 16: 10 steps per epoch.
    # A checkpoint at step 15 (mid epoch 1), a crash at step 25 (in epoch 2), after the first
    # attempt reported epochs 0 and 1: the resumed attempt restarts in epoch 1.
    body = {
        "data": {"kind": "synthetic", "samples": 200, "features": 8, "classes": 3},
        "model": {"input_size": 8, "hidden": [8], "num_classes": 3},
        "training": {
            "epochs": 3,
            "batch_size": 16,
            "steps_per_execution": 5,
            "validation_split": 0.2,
            "checkpoint_every": 15,
        },
        "precision": {"policy": "float32"},
        "outputs": {"save_model": False},
        "faults": crash_once_after(25),
        "max_attempts": 2,
    }
    job_id = submit_spec(api, body)
    job = finished(api, job_id)
    assert job["status"] == "succeeded", job["error"]
    assert job["attempt"] == 2, job["attempt_errors"]

    epochs = api.get(f"/v1/jobs/{job_id}/metrics").json()["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    for e in epochs:
        assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(e["metrics"]), e
    assert epochs[-1]["metrics"] == {
        k: v for k, v in job["summary"]["metrics"]["last_epoch"].items() if k != "epoch"
    }
    # Epoch 1 as the resumed attempt saw it: Keras' running mean over the batches it ran
    # (steps 15..19), not the first attempt's (steps 10..19).
    losses = [r["loss"] for r in all_history(api, job_id)]
    assert len(losses) == 30
    resumed = sum(losses[15:20]) / 5
    whole = sum(losses[10:20]) / 10
    assert epochs[1]["metrics"]["loss"] == pytest.approx(resumed, rel=1e-4)
    assert epochs[1]["metrics"]["loss"] != pytest.approx(whole, rel=1e-4)
    assert epochs[2]["metrics"]["loss"] == pytest.approx(sum(losses[20:30]) / 10, rel=1e-4)


def test_what_a_user_s_callbacks_put_in_keras_logs_is_bounded_before_it_is_stored() -> None:
    """A code job's callbacks can put anything in Keras' logs, and the child sends it: the
    supervisor keeps at most MAX_METRICS names, each cut to MAX_NAME characters, and only
    finite numbers (anything else is null), so a hostile job cannot grow the row."""
    hostile: dict[Any, Any] = {"n" * 5_000: 1.5}
    hostile |= {f"m{i}": float(i) for i in range(epochmetrics.MAX_METRICS + 50)}
    hostile["m0"] = "x" * 10_000
    hostile["m1"] = True
    hostile["m2"] = math.inf
    hostile["m3"] = [1, 2, 3]
    cleaned = epochmetrics.clean_epoch(2**40, hostile)
    metrics = cleaned["metrics"]
    assert cleaned["epoch"] == epochmetrics.MAX_EPOCH
    assert len(metrics) == epochmetrics.MAX_METRICS
    assert all(len(name) <= epochmetrics.MAX_NAME for name in metrics)
    assert metrics["n" * epochmetrics.MAX_NAME] == 1.5  # kept, its name cut
    assert metrics["m0"] is None and metrics["m1"] is None and metrics["m2"] is None
    assert metrics["m3"] is None and metrics["m4"] == 4.0
    assert epochmetrics.clean_epoch(-3, "not a mapping") == {"epoch": 0, "metrics": {}}
