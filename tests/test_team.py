"""A team sharing one server: who may do what (every endpoint x no token / bad token / other
user / admin), fair scheduling, per-user limits, dataset uploads and metrics."""

from __future__ import annotations

import io
import zipfile
from typing import Any

import numpy as np
import pytest
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from service.database.db import Database
from service.database.models import Job, utcnow
from service.scheduling import fairshare
from service.settings import Settings
from tests.conftest import Api, Team
from tests.test_claims import claim, make_jobs

# (method, path template, body, who may: "team" = any user, "owner" = owner or admin)
ENDPOINTS: list[tuple[str, str, Any, str]] = [
    ("GET", "/v1/jobs", None, "team"),
    ("POST", "/v1/jobs?dry_run=true", {}, "team"),
    ("GET", "/v1/jobs/{id}", None, "team"),
    ("GET", "/v1/jobs/{id}/history", None, "team"),
    ("GET", "/v1/jobs/{id}/history?points=10", None, "team"),
    ("GET", "/v1/jobs/{id}/history.csv", None, "team"),
    ("GET", "/v1/jobs/{id}/loss-scale/events", None, "team"),
    ("GET", "/v1/jobs/{id}/metrics", None, "team"),
    ("GET", "/v1/me", None, "team"),
    ("GET", "/v1/jobs/{id}/logs", None, "team"),
    ("GET", "/v1/jobs/{id}/artifacts", None, "team"),
    ("GET", "/v1/history?job_ids={id}", None, "team"),
    ("GET", "/v1/policies", None, "team"),
    ("GET", "/v1/datasets", None, "team"),
    ("PATCH", "/v1/jobs/{id}", {"priority": 70}, "owner"),
    ("POST", "/v1/jobs/{id}/cancel", None, "owner"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "who"), ENDPOINTS, ids=[f"{m} {p}" for m, p, _, _ in ENDPOINTS]
)
def test_auth_matrix(api: Api, team: Team, method: str, path: str, body: Any, who: str) -> None:
    def call(token: str | None, job_id: int) -> int:
        kwargs = {"json": body} if body is not None else {}
        status: int = (
            api.as_user(token).request(method, path.format(id=job_id), **kwargs).status_code
        )
        return status

    # Fresh jobs per caller, since cancel changes state.
    jobs = [api.post("/v1/jobs", json={}).json()["id"] for _ in range(3)]
    assert call(None, jobs[0]) == 401
    assert call("hw_bogus", jobs[0]) == 401
    assert call("Basic abc", jobs[0]) == 401
    other = call(team.bob, jobs[0])
    admin = call(team.admin, jobs[1])
    owner = call(team.alice, jobs[2])
    ok = {200, 201, 202}
    assert owner in ok and admin in ok
    assert (other in ok) if who == "team" else (other == 403)


def test_healthz_and_metrics_need_no_token(api: Api) -> None:
    anon = api.as_user(None)
    assert anon.get("/healthz").status_code == 200
    assert anon.get("/metrics").status_code == 200


def test_a_user_with_ten_queued_jobs_does_not_starve_another_users_one(db: Database) -> None:
    make_jobs(db, 10, owner="alice")
    (bobs,) = make_jobs(db, 1, owner="bob")
    first = claim(db, "w1")
    second = claim(db, "w2")
    assert first is not None and second is not None
    # alice's oldest goes first (nobody runs anything); then bob has fewer running jobs.
    assert second.job_id == bobs


def test_at_equal_use_fairness_counts_running_jobs_not_queue_length(db: Database) -> None:
    a = make_jobs(db, 3, owner="alice")
    b = make_jobs(db, 3, owner="bob")
    # At one instant (before any job has run a moment) both owners have used nothing, so the
    # fair-share order falls back on running jobs: owners alternate, each in age order. (As
    # time passes, an owner whose jobs started earlier has used more: tests/test_fair_share.py.)
    instant = utcnow()
    order = [claim(db, f"w{i}", at=instant).job_id for i in range(6)]  # type: ignore[union-attr]
    assert order == [a[0], b[0], a[1], b[1], a[2], b[2]]


def test_priority_beats_fairness(db: Database) -> None:
    make_jobs(db, 1, owner="alice")
    (urgent,) = make_jobs(db, 1, owner="alice", priority=90)
    make_jobs(db, 1, owner="bob")
    assert claim(db, "w").job_id == urgent  # type: ignore[union-attr]


def test_per_user_running_limit(db: Database) -> None:
    make_jobs(db, 5, owner="alice")
    (bobs,) = make_jobs(db, 1, owner="bob")
    got = [claim(db, f"w{i}", rule=fairshare.Rule(max_running_per_user=2)) for i in range(5)]
    claimed = [c.job_id for c in got if c is not None]
    assert len(claimed) == 3 and bobs in claimed  # two of alice's, bob's one, then nothing


def _npz(**arrays: Any) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _upload(api: Api, name: str, content: bytes) -> Any:
    return api.post(
        "/v1/datasets",
        files={"file": ("data.npz", content, "application/octet-stream")},
        data={"name": name},
    )


def test_upload_a_dataset_then_train_on_it_by_path(api: Api, settings: Settings) -> None:
    x = np.zeros((20, 4), np.float32)
    y = np.zeros((20,), np.int64)
    r = _upload(api, "tiny", _npz(x_train=x, y_train=y, x_val=x[:5], y_val=y[:5]))
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["path"] == "uploads/alice/tiny.npz"
    assert body["arrays"]["x_train"] == {"shape": [20, 4], "dtype": "float32"}
    assert (settings.resolved_data_dir() / body["path"]).is_file()
    spec = {
        "data": {"kind": "npz", "path": body["path"]},
        "model": {"input_size": 4, "num_classes": 2},
    }
    assert api.post("/v1/jobs?dry_run=true", json=spec).status_code == 200
    assert body["path"] in [d["path"] for d in api.get("/v1/datasets").json()]
    assert _upload(api, "tiny", _npz(x_train=x, y_train=y)).status_code == 409


@pytest.mark.parametrize(
    ("content", "rule"),
    [
        (b"not a zip at all", "not_npz"),
        (_npz(x_train=np.zeros((3, 2)), y_train=np.zeros((4,), np.int64)), "shape"),
        (_npz(x_train=np.zeros((3,)), y_train=np.zeros((3,), np.int64)), "shape"),
        (_npz(x_train=np.zeros((3, 2)), y_train=np.zeros((3,), np.complex64)), "dtype"),
        (_npz(x_train=np.array([["a"]] * 3), y_train=np.zeros((3,), np.int64)), "dtype"),
        (_npz(x_train=np.zeros((3, 2))), "arrays"),
        (
            _npz(x_train=np.zeros((3, 2)), y_train=np.zeros(3, np.int64), extra=np.zeros(1)),
            "arrays",
        ),
        (
            _npz(x_train=np.array([{"a": 1}] * 3, dtype=object), y_train=np.zeros(3, np.int64)),
            "pickle",
        ),
    ],
    ids=[
        "not-npz",
        "length-mismatch",
        "no-features",
        "complex-labels",
        "strings",
        "missing-y",
        "extra-array",
        "pickle",
    ],
)
def test_bad_uploads_are_422_and_leave_nothing(
    api: Api, settings: Settings, content: bytes, rule: str
) -> None:
    r = _upload(api, "bad", content)
    assert r.status_code == 422, r.text
    assert r.json()["fields"][0] == {
        "field": "file",
        "rule": rule,
        "message": r.json()["fields"][0]["message"],
    }
    assert not list((settings.resolved_data_dir()).rglob("*.npz"))
    assert not list((settings.resolved_data_dir()).rglob("*.part"))


def test_upload_names_cannot_escape(api: Api) -> None:
    content = _npz(x_train=np.zeros((3, 2)), y_train=np.zeros(3, np.int64))
    for name in ("../../evil", "/abs", ".hidden", "a/b"):
        r = _upload(api, name, content)
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "name", name


def test_too_large_upload_is_refused(api: Api, settings: Settings) -> None:
    settings.max_upload_bytes = 1000
    big = _npz(x_train=np.zeros((100, 10)), y_train=np.zeros(100, np.int64))
    r = _upload(api, "big", big)
    assert r.status_code in (413, 422)
    assert "1000" in r.json()["message"]


def test_npz_holding_a_zip_member_that_is_not_an_array_is_refused(api: Api) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("x_train.npy", b"\x93NUMPY garbage")
        z.writestr("notes.txt", b"hi")
    assert _upload(api, "odd", buf.getvalue()).status_code == 422


def test_metrics_move_when_jobs_run(api: Api, db: Database, settings: Settings) -> None:
    from tests import fakes
    from tests.test_supervisor import make_job
    from workers.supervisor import Supervisor

    def scrape() -> dict[str, float]:
        text = api.get("/metrics").text
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    before = scrape()
    make_job(db, {"steps": 25})
    mid = scrape()
    assert (
        mid['halfway_jobs{status="queued"}'] == before.get('halfway_jobs{status="queued"}', 0) + 1
    )
    Supervisor(db, settings, trainer=fakes.trainer, worker_id="m1").run_once()
    after = scrape()
    assert after['halfway_jobs{status="succeeded"}'] == 1
    assert after["halfway_steps_recorded_total"] == before["halfway_steps_recorded_total"] + 25
    assert after['halfway_job_duration_seconds_count{status="succeeded"}'] == 1
    assert after["halfway_history_write_seconds_count"] > before.get(
        "halfway_history_write_seconds_count", 0
    )
    assert any(k.startswith("halfway_http_request_duration_seconds_count") for k in after)


def test_the_vocabulary_is_public_and_is_what_the_database_accepts(api: Api, db: Database) -> None:
    words = api.as_user(None).get("/v1/vocabulary").json()
    assert set(words["finished_statuses"]) < set(words["job_statuses"])
    (job_id,) = make_jobs(db, 1, owner="alice")
    for status in words["job_statuses"]:
        with db.write() as session:
            session.execute(update(Job).where(Job.id == job_id).values(status=status))
    with pytest.raises(IntegrityError), db.write() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status="paused"))
