"""Every job endpoint, on SQLite and PostgreSQL, through the real app."""

from __future__ import annotations

import math
from typing import Any

from service.api.responses import HistoryPage
from service.database.db import Database
from service.database.models import Job, utcnow
from service.recording import history
from service.recording.records import StepRecord
from tests.conftest import Api, Team
from tests.waiting import eventually


def _submit(api: Api, **spec: object) -> dict[str, Any]:
    r = api.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def test_submit_returns_201_with_queued_job_and_location(api: Api) -> None:
    r = api.post("/v1/jobs", json={"name": "first"})
    assert r.status_code == 201
    job = r.json()
    assert job["status"] == "queued"
    assert job["owner"] == "alice"
    assert job["name"] == "first"
    assert job["attempt"] == 0
    assert job["spec"]["loss_scale"]["mode"] == "dynamic"
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"
    assert api.get(f"/v1/jobs/{job['id']}").json()["id"] == job["id"]


def test_dry_run_stores_nothing(api: Api) -> None:
    r = api.post("/v1/jobs?dry_run=true", json={})
    assert r.status_code == 200
    assert set(r.json()) == {"spec", "warnings", "notes"}
    assert api.get("/v1/jobs").json()["items"] == []


def test_default_name_says_model_and_policy(api: Api) -> None:
    job = _submit(api, precision={"policy": "mixed_bfloat16"})
    assert job["name"] == "mlp-mixed_bfloat16"


def test_list_is_newest_first_with_cursor_paging(api: Api) -> None:
    ids = [_submit(api, name=f"j{i}")["id"] for i in range(5)]
    page = api.get("/v1/jobs?limit=2").json()
    assert [j["id"] for j in page["items"]] == ids[::-1][:2]
    seen = [j["id"] for j in page["items"]]
    while page["next_cursor"]:
        page = api.get(f"/v1/jobs?limit=2&cursor={page['next_cursor']}").json()
        seen += [j["id"] for j in page["items"]]
    assert seen == ids[::-1]


def test_list_filters_by_status_and_owner(api: Api, team: Team) -> None:
    a = _submit(api)["id"]
    b = _submit(api.as_user(team.bob))["id"]
    api.post(f"/v1/jobs/{a}/cancel")
    assert [j["id"] for j in api.get("/v1/jobs?status=cancelled").json()["items"]] == [a]
    assert [j["id"] for j in api.get("/v1/jobs?status=queued").json()["items"]] == [b]
    assert [j["id"] for j in api.get("/v1/jobs?owner=bob").json()["items"]] == [b]
    assert api.get("/v1/jobs?status=bogus").status_code == 422
    assert api.get("/v1/jobs?limit=0").status_code == 422
    assert api.get("/v1/jobs?cursor=abc").status_code == 422


def test_get_unknown_job_is_404_json(api: Api) -> None:
    r = api.get("/v1/jobs/999999")
    assert r.status_code == 404
    assert r.json()["error"] == "not_found"


def test_job_etag_gives_304_until_the_job_changes(api: Api) -> None:
    job_id = _submit(api)["id"]
    first = api.get(f"/v1/jobs/{job_id}")
    etag = first.headers["etag"]
    again = api.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": etag})
    assert again.status_code == 304
    assert again.content == b""
    api.post(f"/v1/jobs/{job_id}/cancel")
    changed = api.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": etag})
    assert changed.status_code == 200
    assert changed.headers["etag"] != etag


def test_cancel_queued_job_cancels_it_at_once(api: Api) -> None:
    job_id = _submit(api)["id"]
    r = api.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 202
    assert r.json()["status"] == "cancelled"
    assert r.json()["finished_at"] is not None
    # Asking again is harmless; a finished job that was not cancelled is a conflict.
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202


def test_cancel_finished_job_is_409(api: Api, db: Database) -> None:
    job_id = _submit(api)["id"]
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.status = "succeeded"
    r = api.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 409
    assert "already finished" in r.json()["message"]


def test_cancel_running_job_sets_the_flag_for_its_worker(api: Api, db: Database) -> None:
    job_id = _submit(api)["id"]
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.status, job.worker_id = "running", "w1"
    r = api.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 202
    assert r.json()["status"] == "running"
    assert r.json()["cancel_requested"] is True


def test_only_owner_or_admin_may_cancel(api: Api, team: Team) -> None:
    job_id = _submit(api)["id"]
    r = api.as_user(team.bob).post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 403
    assert api.as_user(team.admin).post(f"/v1/jobs/{job_id}/cancel").status_code == 202


def test_priority_patch_owner_or_admin_and_queued_only(api: Api, team: Team) -> None:
    job_id = _submit(api)["id"]
    assert (
        api.as_user(team.bob).patch(f"/v1/jobs/{job_id}", json={"priority": 90}).status_code == 403
    )
    r = api.patch(f"/v1/jobs/{job_id}", json={"priority": 90})
    assert r.status_code == 200 and r.json()["priority"] == 90
    assert api.patch(f"/v1/jobs/{job_id}", json={"priority": 101}).status_code == 422
    api.post(f"/v1/jobs/{job_id}/cancel")
    assert api.patch(f"/v1/jobs/{job_id}", json={"priority": 10}).status_code == 409


def _write(db: Database, job_id: int, records: list[StepRecord]) -> None:
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        history.write_steps(s, job, records, now=utcnow())


def test_history_cursor_returns_only_new_rows(api: Api, db: Database) -> None:
    job_id = _submit(api)["id"]
    _write(db, job_id, [StepRecord(s, 0, 1.0 / (s + 1), 1024.0, True) for s in range(25)])
    page = api.get(f"/v1/jobs/{job_id}/history?limit=10").json()
    HistoryPage.model_validate(page)
    assert [r["step"] for r in page["items"]] == list(range(10))
    assert page["has_more"] is True and page["next_after_step"] == 9
    rest = api.get(f"/v1/jobs/{job_id}/history?after_step=9&limit=100").json()
    assert [r["step"] for r in rest["items"]] == list(range(10, 25))
    assert rest["has_more"] is False
    empty = api.get(f"/v1/jobs/{job_id}/history?after_step=24").json()
    assert empty["items"] == [] and empty["next_after_step"] == 24
    _write(db, job_id, [StepRecord(25, 0, 0.1, 1024.0, True)])
    # Written behind the API's back, as a worker does: served once the job's poll snapshot
    # has aged (HALFWAY_POLL_CACHE_SECONDS), so a poller reads on until it comes.
    new = eventually(
        lambda: api.get(f"/v1/jobs/{job_id}/history?after_step=24").json(),
        lambda page: bool(page["items"]),
    )
    assert [r["step"] for r in new["items"]] == [25]


def test_history_etag_304_until_new_rows(api: Api, db: Database) -> None:
    job_id = _submit(api)["id"]
    _write(db, job_id, [StepRecord(0, 0, 1.0, 8.0, True)])
    r = api.get(f"/v1/jobs/{job_id}/history")
    assert (
        api.get(
            f"/v1/jobs/{job_id}/history", headers={"If-None-Match": r.headers["etag"]}
        ).status_code
        == 304
    )
    _write(db, job_id, [StepRecord(1, 0, 1.0, 8.0, True)])
    changed = eventually(  # once the poll snapshot has aged, as in test_history_cursor_...
        lambda: api.get(f"/v1/jobs/{job_id}/history", headers={"If-None-Match": r.headers["etag"]}),
        lambda response: response.status_code != 304,
    )
    assert changed.status_code == 200
    assert [row["step"] for row in changed.json()["items"]] == [0, 1]


def test_nonfinite_losses_round_trip_as_null_with_a_flag(api: Api, db: Database) -> None:
    job_id = _submit(api)["id"]
    _write(
        db,
        job_id,
        [
            StepRecord(0, 0, math.nan, 1024.0, False),
            StepRecord(1, 0, math.inf, 512.0, False),
            StepRecord(2, 0, -math.inf, 256.0, False),
            StepRecord(3, 0, 0.25, 256.0, True),
        ],
    )
    r = api.get(f"/v1/jobs/{job_id}/history")
    assert "NaN" not in r.text and "Infinity" not in r.text
    items = r.json()["items"]
    assert [(i["loss"], i["loss_nonfinite"]) for i in items] == [
        (None, "nan"),
        (None, "inf"),
        (None, "-inf"),
        (0.25, None),
    ]
    assert [i["finite"] for i in items] == [False, False, False, True]
    summary = api.get(f"/v1/jobs/{job_id}").json()["summary"]
    assert summary["overflow_count"] == 3
    assert summary["nonfinite_loss_count"] == 3
    assert summary["last_loss"] == 0.25


def test_history_of_unknown_job_is_404(api: Api) -> None:
    assert api.get("/v1/jobs/424242/history").status_code == 404


def test_history_rejects_bad_cursor_values(api: Api) -> None:
    job_id = _submit(api)["id"]
    assert api.get(f"/v1/jobs/{job_id}/history?after_step=-2").status_code == 422
    assert api.get(f"/v1/jobs/{job_id}/history?limit=100000").status_code == 422


def test_policies_report_variable_and_compute_dtypes(api: Api) -> None:
    policies = {p["name"]: p for p in api.get("/v1/policies").json()}
    assert policies["mixed_float16"]["variable_dtype"] == "float32"
    assert policies["mixed_float16"]["compute_dtype"] == "float16"
    assert policies["mixed_float16"]["loss_scaling_advised"] is True
    assert policies["mixed_bfloat16"]["compute_dtype"] == "bfloat16"
    assert policies["mixed_bfloat16"]["loss_scaling_advised"] is False


def test_healthz_needs_no_token(api: Api, db: Database) -> None:
    r = api.as_user(None).get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "database": db.dialect}


def test_v1_needs_a_valid_token(api: Api) -> None:
    anon = api.as_user(None)
    for method, path in [("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/policies")]:
        r = anon.request(method, path, json={})
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
    bad = api.as_user("hw_not-a-real-token")
    assert bad.get("/v1/jobs").status_code == 401


def test_idempotency_key_returns_the_first_job(api: Api, team: Team) -> None:
    headers = {"Idempotency-Key": "nightly-42"}
    first = api.post("/v1/jobs", json={"name": "a"}, headers=headers)
    assert first.status_code == 201
    again = api.post("/v1/jobs", json={"name": "a"}, headers=headers)
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    other = api.post("/v1/jobs", json={"name": "b"}, headers=headers)
    assert other.status_code == 409
    # Keys are per user: bob's same key is a new job.
    bobs = api.as_user(team.bob).post("/v1/jobs", json={"name": "a"}, headers=headers)
    assert bobs.status_code == 201 and bobs.json()["id"] != first.json()["id"]
    assert len(api.get("/v1/jobs").json()["items"]) == 2


def test_oversized_body_is_413_before_parsing(api: Api, settings: object) -> None:
    big = b'{"name": "' + b"x" * 2_000_000 + b'"}'
    r = api.post("/v1/jobs", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"] == "payload_too_large"


def test_logs_tail_and_follow_by_offset(api: Api, settings: Any) -> None:
    job_id = _submit(api)["id"]
    assert api.get(f"/v1/jobs/{job_id}/logs").text == ""  # no log yet
    folder = settings.resolved_artifact_dir() / str(job_id)
    folder.mkdir(parents=True)
    log = folder / "train.log"
    log.write_text("line one\nline two\n")
    r = api.get(f"/v1/jobs/{job_id}/logs?tail=9")
    assert r.text == "line two\n"
    offset = int(r.headers["x-log-offset"])
    assert offset == len("line one\nline two\n")
    with log.open("a") as f:
        f.write("line three\n")
    follow = api.get(f"/v1/jobs/{job_id}/logs?offset={offset}")
    assert follow.text == "line three\n"
    assert int(follow.headers["x-log-offset"]) == offset + len("line three\n")


def test_artifacts_are_listed_and_served_by_name_only(api: Api, settings: Any) -> None:
    job_id = _submit(api)["id"]
    assert api.get(f"/v1/jobs/{job_id}/artifacts").json() == []
    assert api.get(f"/v1/jobs/{job_id}/artifacts/model.keras").status_code == 404
    folder = settings.resolved_artifact_dir() / str(job_id)
    folder.mkdir(parents=True)
    (folder / "model.keras").write_bytes(b"PK\x03\x04 not really a model")
    (folder / "checkpoint.npz").write_bytes(b"private")
    listed = api.get(f"/v1/jobs/{job_id}/artifacts").json()
    assert [a["name"] for a in listed] == ["model.keras"]
    r = api.get(f"/v1/jobs/{job_id}/artifacts/model.keras")
    assert r.status_code == 200 and r.content.startswith(b"PK")
    for name in ("checkpoint.npz", "..%2F..%2Fetc%2Fpasswd", "../1/model.keras"):
        assert api.get(f"/v1/jobs/{job_id}/artifacts/{name}").status_code == 404


def test_job_list_has_an_etag_and_large_responses_are_gzipped(api: Api, db: Database) -> None:
    job_id = _submit(api)["id"]
    first = api.get("/v1/jobs")
    assert api.get("/v1/jobs", headers={"If-None-Match": first.headers["etag"]}).status_code == 304
    _write(db, job_id, [StepRecord(s, 0, 0.5, 1024.0, True) for s in range(3000)])
    r = api.get(f"/v1/jobs/{job_id}/history?limit=3000", headers={"Accept-Encoding": "gzip"})
    assert r.headers["content-encoding"] == "gzip"
    assert len(r.json()["items"]) == 3000  # httpx decodes it


def test_poll_cache_answers_repeated_polls_without_the_database(
    settings: Any, db: Database, team: Team
) -> None:
    from fastapi.testclient import TestClient
    from sqlalchemy import event

    from service.api.app import create_app

    settings.poll_cache_seconds = 60  # long enough that this test never sees it expire
    with TestClient(create_app(settings, db, auth=True)) as client:
        api = Api(client, team.alice)
        job_id = _submit(api)["id"]
        _write(db, job_id, [StepRecord(s, 0, 0.5, 1024.0, True) for s in range(10)])
        first = api.get(f"/v1/jobs/{job_id}")
        assert first.json()["summary"]["last_step"] == 9
        queries: list[str] = []

        def count(*args: Any) -> None:
            queries.append(str(args[2]))

        event.listen(db.engine, "before_cursor_execute", count)
        try:
            for _ in range(5):
                assert api.get(f"/v1/jobs/{job_id}").headers["etag"] == first.headers["etag"]
                page = api.get(f"/v1/jobs/{job_id}/history?after_step=9").json()
                assert page["items"] == [] and page["next_after_step"] == 9
        finally:
            event.remove(db.engine, "before_cursor_execute", count)
        assert [q for q in queries if "FROM job" in q or "FROM step" in q] == []
        # A poller behind the snapshot reads its rows, up to the snapshot's last step, so
        # pollers' cursors meet there and the page is shared: rows written since wait for the
        # next snapshot, and asking again costs no query.
        _write(db, job_id, [StepRecord(s, 0, 0.5, 1024.0, True) for s in range(10, 15)])
        behind = api.get(f"/v1/jobs/{job_id}/history?after_step=4").json()
        HistoryPage.model_validate(behind)
        assert [r["step"] for r in behind["items"]] == [5, 6, 7, 8, 9]
        queries.clear()
        event.listen(db.engine, "before_cursor_execute", count)
        try:
            again = api.get(f"/v1/jobs/{job_id}/history?after_step=4")
        finally:
            event.remove(db.engine, "before_cursor_execute", count)
        assert again.json() == behind
        assert [q for q in queries if "FROM job" in q or "FROM step" in q] == []
        # A change made through the API is visible at once.
        api.post(f"/v1/jobs/{job_id}/cancel")
        assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
