"""Gradient samples stored and served: idempotent writes on (job_id, step), the job's summary
keeping the latest sample and shadow sample, a cut deleting samples with the history and
moving history_version, and ``GET /v1/jobs/{id}/gradients`` in step order (JSON pages,
columns, Arrow, Parquet) with its 404s and 422s. SQLite and PostgreSQL."""

from __future__ import annotations

import io
import math
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from service.api.responses import GradientColumnsPage, GradientsPage, JobOut
from service.database.db import Database
from service.database.models import Job
from service.recording import gradients, history
from tests import fakes
from tests.conftest import Api
from tests.test_history_queries import submit, synthetic_history, write
from tests.test_supervisor import load
from tests.waiting import eventually


def sample(step: int, **kw: Any) -> dict[str, Any]:
    return gradients.clean_sample(fakes.fake_sample(step, **kw))


def store(db: Database, job_id: int, samples: list[dict[str, Any]]) -> None:
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        gradients.write_samples(s, job, samples)


def stored(db: Database, job_id: int) -> list[dict[str, Any]]:
    with db.read() as s:
        found, more = gradients.read_samples(s, job_id, after_step=-1, limit=100_000)
    assert not more
    return found


def truncate(db: Database, job_id: int, step: int) -> Job:
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        history.truncate_after(s, job, step)
    return load(db, job_id)


# --------------------------------------------------------------------------------------------
# The store


def test_samples_are_read_back_in_step_order_with_their_variables(api: Api, db: Database) -> None:
    job_id = submit(api)
    # Two flushes, the second's steps interleaved with the first's: the reads order them.
    store(db, job_id, [sample(s, shadow=s % 20 == 0) for s in range(0, 100, 20)])
    store(db, job_id, [sample(s) for s in range(10, 100, 20)])
    found = stored(db, job_id)
    assert [s["step"] for s in found] == list(range(0, 100, 10))
    assert found[3] == sample(30)
    assert [v["name"] for v in found[0]["variables"]] == list(fakes.VARIABLES)
    assert found[0]["underflow_share"] == 0.03125 and found[1]["underflow_share"] is None


def test_a_sample_sent_again_replaces_the_stored_one_and_makes_no_duplicate(
    api: Api, db: Database
) -> None:
    job_id = submit(api)
    store(db, job_id, [sample(0), sample(10)])
    store(db, job_id, [sample(10, attempt=2), sample(20)])  # a batch resent, and more
    found = stored(db, job_id)
    assert [s["step"] for s in found] == [0, 10, 20]
    assert found[1] == sample(10, attempt=2)
    assert load(db, job_id).gradients_summary == {
        "latest": gradients.model_level(sample(20)),
        "latest_shadow": None,
    }


def test_the_summary_keeps_the_latest_sample_and_the_latest_shadow_sample(
    api: Api, db: Database
) -> None:
    job_id = submit(api)
    store(db, job_id, [sample(s, shadow=s % 50 == 0) for s in range(0, 80, 10)])
    summary = load(db, job_id).gradients_summary
    assert summary is not None
    assert summary["latest"] == gradients.model_level(sample(70))
    assert summary["latest_shadow"] == gradients.model_level(sample(50, shadow=True))
    assert "variables" not in summary["latest"]


def test_a_cut_deletes_samples_from_the_cut_recomputes_the_summary_and_moves_the_version(
    api: Api, db: Database
) -> None:
    job_id = submit(api)
    write(db, job_id, synthetic_history(100, seed=1))
    store(db, job_id, [sample(s, shadow=s % 30 == 0) for s in range(0, 100, 10)])
    job = truncate(db, job_id, 65)
    assert [s["step"] for s in stored(db, job_id)] == [0, 10, 20, 30, 40, 50, 60]
    assert (job.history_version, job.history_reset_step) == (1, 65)
    assert job.gradients_summary == {
        "latest": gradients.model_level(sample(60, shadow=True)),
        "latest_shadow": gradients.model_level(sample(60, shadow=True)),
    }
    job = truncate(db, job_id, 25)
    assert job.gradients_summary is not None
    assert job.gradients_summary["latest"]["step"] == 20
    assert job.gradients_summary["latest_shadow"]["step"] == 0
    job = truncate(db, job_id, 0)
    assert stored(db, job_id) == [] and job.gradients_summary is None


def test_a_cut_that_forgets_only_samples_still_moves_the_version(api: Api, db: Database) -> None:
    """A sample of a step whose row is not stored (a sample may arrive before its step's
    row is flushed): forgetting it is a rewrite all the same."""
    job_id = submit(api)
    write(db, job_id, synthetic_history(40, seed=2))
    store(db, job_id, [sample(40)])
    job = truncate(db, job_id, 40)
    assert (job.history_version, job.history_reset_step) == (1, 40)
    assert stored(db, job_id) == []
    job = truncate(db, job_id, 40)  # nothing left to forget: the version stays
    assert job.history_version == 1


def test_a_sample_is_cleaned_before_it_is_stored() -> None:
    raw = fakes.fake_sample(3, shadow=True)
    raw["zero_share"] = math.nan
    raw["headroom"] = math.inf
    raw["variables"][0]["name"] = "x" * 500
    raw["variables"][1]["lost_share"] = -math.inf
    clean = gradients.clean_sample(raw)
    assert clean["zero_share"] is None and clean["headroom"] is None
    assert clean["variables"][0]["name"] == "x" * gradients.MAX_NAME
    assert clean["variables"][1]["lost_share"] is None
    for bad in ({"step": -1}, {"step": True}, {"step": "3"}, {"loss_scale": math.inf}):
        with pytest.raises((ValueError, TypeError)):
            gradients.clean_sample({**fakes.fake_sample(3), **bad})


# --------------------------------------------------------------------------------------------
# The API


def test_samples_are_served_in_step_order_page_by_page(api: Api, db: Database) -> None:
    job_id = submit(api)
    expected = [sample(s, shadow=s % 40 == 0) for s in range(0, 250, 10)]
    store(db, job_id, expected)
    got: list[dict[str, Any]] = []
    after = -1
    while after is not None:
        r = api.get(f"/v1/jobs/{job_id}/gradients?after_step={after}&limit=7")
        assert r.status_code == 200, r.text
        page = GradientsPage.model_validate(r.json()).model_dump()
        assert page["job_id"] == job_id and page["history_version"] == 0
        assert len(page["samples"]) <= 7
        got += page["samples"]
        after = page["next_after_step"]
    assert got == expected
    default = api.get(f"/v1/jobs/{job_id}/gradients").json()
    assert len(default["samples"]) == 25 and default["next_after_step"] is None
    tail = api.get(f"/v1/jobs/{job_id}/gradients?after_step=240").json()
    assert tail["samples"] == [] and tail["next_after_step"] is None


def test_a_page_carries_an_etag_and_the_version_moves_with_a_cut(api: Api, db: Database) -> None:
    job_id = submit(api)
    store(db, job_id, [sample(s) for s in range(0, 50, 10)])
    url = f"/v1/jobs/{job_id}/gradients"
    first = api.get(url)
    assert first.headers["etag"].startswith('"h0-')
    seen = {"If-None-Match": first.headers["etag"]}
    assert api.get(url, headers=seen).status_code == 304
    truncate(db, job_id, 30)
    cut = api.get(url, headers=seen)
    assert cut.status_code == 200 and cut.headers["etag"].startswith('"h1-')
    assert cut.json()["history_version"] == 1
    assert [s["step"] for s in cut.json()["samples"]] == [0, 10, 20]


def test_columns_hold_the_model_level_figures(api: Api, db: Database) -> None:
    job_id = submit(api)
    expected = [sample(s, shadow=s % 20 == 0, finite=s != 30) for s in range(0, 60, 10)]
    store(db, job_id, expected)
    r = api.get(f"/v1/jobs/{job_id}/gradients?format=columns&after_step=0")
    assert r.status_code == 200, r.text
    page = GradientColumnsPage.model_validate(r.json())
    body = r.json()
    assert (body["job_id"], body["history_version"]) == (job_id, 0)
    assert set(body["columns"]) == set(gradients.MODEL_COLUMNS)
    for name in gradients.MODEL_COLUMNS:
        assert body["columns"][name] == [s[name] for s in expected[1:]], name
    assert page.columns.finite == [True, True, False, True, True]
    paged = api.get(f"/v1/jobs/{job_id}/gradients?format=columns&limit=2").json()
    assert paged["columns"]["step"] == [0, 10] and paged["next_after_step"] == 10


def _long_rows(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for s in samples:
        for v in [{"name": gradients.MODEL_ROW, **s}, *s["variables"]]:
            rows.append(
                {
                    "step": s["step"],
                    "variable": v["name"],
                    "loss_scale": s["loss_scale"],
                    "shadow": s["shadow"],
                    "finite": v["finite"],
                    **{name: v[name] for name in gradients.FIGURES},
                }
            )
    return rows


@pytest.mark.parametrize("kind", ["arrow", "parquet"])
def test_arrow_and_parquet_hold_the_long_table_one_row_per_step_and_variable(
    api: Api, db: Database, kind: str
) -> None:
    job_id = submit(api)
    expected = [sample(s, shadow=s % 20 == 0) for s in range(0, 2500, 10)]  # three chunks
    store(db, job_id, expected)
    r = api.get(f"/v1/jobs/{job_id}/gradients?format={kind}")
    assert r.status_code == 200, r.text
    if kind == "arrow":
        assert r.headers["content-type"] == "application/vnd.apache.arrow.stream"
        table = pa.ipc.open_stream(r.content).read_all()
    else:
        assert r.headers["content-type"] == "application/vnd.apache.parquet"
        table = pq.read_table(io.BytesIO(r.content))
    assert table.schema.field("step").type == pa.int32()
    assert table.schema.field("variable").type == pa.string()
    assert table.to_pylist() == _long_rows(expected)
    part = api.get(f"/v1/jobs/{job_id}/gradients?format={kind}&after_step=100&limit=3")
    read = pa.ipc.open_stream if kind == "arrow" else (lambda b: pq.ParquetFile(io.BytesIO(b)))
    got = read(part.content).read_all() if kind == "arrow" else read(part.content).read()
    assert got.to_pylist() == _long_rows(expected[11:14])


def test_a_job_without_samples_answers_empty_in_every_format(api: Api) -> None:
    job_id = submit(api)
    assert api.get(f"/v1/jobs/{job_id}/gradients").json() == {
        "job_id": job_id,
        "history_version": 0,
        "samples": [],
        "next_after_step": None,
    }
    cols = api.get(f"/v1/jobs/{job_id}/gradients?format=columns").json()["columns"]
    assert all(v == [] for v in cols.values())
    arrow = api.get(f"/v1/jobs/{job_id}/gradients?format=arrow")
    assert pa.ipc.open_stream(arrow.content).read_all().num_rows == 0
    parquet = api.get(f"/v1/jobs/{job_id}/gradients?format=parquet")
    assert pq.read_table(io.BytesIO(parquet.content)).num_rows == 0
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["gradients"] is None and job["precision_decision"] is None


@pytest.mark.parametrize(
    "query",
    [
        "after_step=-2",
        f"after_step={2**31}",
        "after_step=abc",
        "limit=0",
        "limit=1001",
        "format=columns&limit=100001",
        f"format=parquet&limit={10**6 + 1}",
        "format=csv",
    ],
)
def test_bad_parameters_are_a_422_naming_the_parameter(api: Api, query: str) -> None:
    job_id = submit(api)
    r = api.get(f"/v1/jobs/{job_id}/gradients?{query}")
    assert r.status_code == 422, r.text
    parameter = query.split("&")[-1].split("=")[0]
    assert [f["field"] for f in r.json()["fields"]] == [f"query.{parameter}"]


@pytest.mark.parametrize("fmt", ["json", "columns", "arrow", "parquet"])
def test_an_unknown_job_is_a_404_and_a_teammates_job_is_readable(
    api: Api, fmt: str, team: Any
) -> None:
    r = api.get(f"/v1/jobs/999999/gradients?format={fmt}")
    assert r.status_code == 404 and r.json()["error"] == "not_found"
    job_id = submit(api)
    assert api.as_user(team.bob).get(f"/v1/jobs/{job_id}/gradients?format={fmt}").status_code == 200
    assert api.as_user(None).get(f"/v1/jobs/{job_id}/gradients?format={fmt}").status_code == 401


def test_the_job_shows_its_latest_samples(api: Api, db: Database) -> None:
    job_id = submit(api)
    store(db, job_id, [sample(s, shadow=s % 30 == 0) for s in range(0, 50, 10)])
    job = eventually(lambda: api.get(f"/v1/jobs/{job_id}").json(), lambda j: j["gradients"])
    JobOut.model_validate(job)
    assert job["gradients"] == {
        "latest": gradients.model_level(sample(40)),
        "latest_shadow": gradients.model_level(sample(30, shadow=True)),
    }
    listed = api.get("/v1/jobs").json()["items"]
    assert [j["gradients"] for j in listed if j["id"] == job_id] == [job["gradients"]]
