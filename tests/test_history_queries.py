"""History at scale: buckets against a brute-force computation over the same rows (overflows,
NaN and inf losses, uneven last bucket, zoom ranges, every rollup level), loss-scale events,
CSV, the event stream and multi-job comparison, on SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import random
import time
from typing import Any

import pytest
from sqlalchemy import text

from service.api.responses import BucketPage
from service.api.routes import history as history_routes
from service.database.db import Database
from service.database.models import Job, StepRollup, utcnow
from service.recording import history, rollups
from service.recording.records import StepRecord
from service.settings import Settings
from tests.conftest import Api


def submit(api: Api) -> int:
    r = api.post("/v1/jobs", json={})
    assert r.status_code == 201
    job_id: int = r.json()["id"]
    return job_id


def synthetic_history(n: int, seed: int, start: int = 0) -> list[StepRecord]:
    """Loss-scale behaviour with overflows (the scale halves after each) and some NaN/inf
    losses; float32-representable values, as TensorFlow produces."""
    rng = random.Random(seed)
    scale = 65536.0
    out = []
    for step in range(start, start + n):
        finite = rng.random() > 0.02
        r = rng.random()
        loss: float
        if r < 0.01:
            loss = math.nan
        elif r < 0.015:
            loss = math.inf if rng.random() < 0.5 else -math.inf
        else:
            loss = float(int(rng.random() * 2**20)) / 2**16  # exact in float32
        out.append(StepRecord(step, step // 500, loss, scale, finite))
        if not finite:
            scale = max(1.0, scale / 2)
        elif rng.random() < 0.01:
            scale = min(2.0**24, scale * 2)
    return out


def write(db: Database, job_id: int, records: list[StepRecord], batch: int = 997) -> None:
    for i in range(0, len(records), batch):
        with db.write() as s:
            job = s.get(Job, job_id)
            assert job is not None
            history.write_steps(s, job, records[i : i + batch], now=utcnow())


def brute_force(
    records: list[StepRecord], lo: int, hi: int, origin: int, width: int
) -> dict[int, dict[str, Any]]:
    cells: dict[int, list[StepRecord]] = {}
    for r in records:
        if lo <= r.step <= hi:
            cells.setdefault((r.step - origin) // width, []).append(r)
    out = {}
    for index, rows in cells.items():
        finite_losses = [r.loss for r in rows if math.isfinite(r.loss)]
        last = max(rows, key=lambda r: r.step)
        out[index] = {
            "index": index,
            "first_step": min(r.step for r in rows),
            "last_step": last.step,
            "count": len(rows),
            "loss_min": min(finite_losses) if finite_losses else None,
            "loss_max": max(finite_losses) if finite_losses else None,
            "loss_last": last.loss if math.isfinite(last.loss) else None,
            "loss_last_nonfinite": None
            if math.isfinite(last.loss)
            else ("nan" if math.isnan(last.loss) else ("inf" if last.loss > 0 else "-inf")),
            "scale_min": min(r.loss_scale for r in rows),
            "scale_max": max(r.loss_scale for r in rows),
            "scale_last": last.loss_scale,
            "overflow_count": sum(1 for r in rows if not r.finite),
            "nonfinite_loss_count": len(rows) - len(finite_losses),
        }
    return out


def check_buckets(
    api: Api,
    job_id: int,
    records: list[StepRecord],
    points: int,
    lo: int | None = None,
    hi: int | None = None,
) -> dict[str, Any]:
    query = f"points={points}"
    if lo is not None:
        query += f"&from_step={lo}"
    if hi is not None:
        query += f"&to_step={hi}"
    r = api.get(f"/v1/jobs/{job_id}/history?{query}")
    assert r.status_code == 200, r.text
    page: dict[str, Any] = r.json()
    BucketPage.model_validate(page)  # the hand-built JSON keeps the documented shape
    lo_ = page["from_step"]
    hi_ = page["to_step"]
    expected = brute_force(records, lo_, hi_, page["origin"], page["width"])
    got = {b["index"]: b for b in page["buckets"]}
    assert got == expected
    assert len(page["buckets"]) <= points
    # The first and last step of the range are always present.
    in_range = [r.step for r in records if lo_ <= r.step <= hi_]
    if in_range:
        assert page["buckets"][0]["first_step"] == in_range[0]
        assert page["buckets"][-1]["last_step"] == in_range[-1]
    return page


@pytest.mark.parametrize("points", [1, 7, 100, 999, 5000])
def test_buckets_equal_brute_force_on_every_grid(api: Api, db: Database, points: int) -> None:
    job_id = submit(api)
    records = synthetic_history(3000, seed=points)
    write(db, job_id, records)
    page = check_buckets(api, job_id, records, points)
    if points == 7:  # wide buckets: served from level-0 rollups
        assert page["width"] % rollups.LEVEL_BLOCKS[0] == 0


def test_zoomed_ranges_with_unaligned_edges_equal_brute_force(api: Api, db: Database) -> None:
    job_id = submit(api)
    records = synthetic_history(3000, seed=3)
    write(db, job_id, records)
    for lo, hi, points in [
        (123, 2777, 5),
        (65, 127, 1),
        (1000, 1000, 10),
        (10, 2990, 33),
        (2500, 9999, 4),
    ]:
        check_buckets(api, job_id, records, points, lo, hi)


def test_every_rollup_level_agrees_with_brute_force(api: Api, db: Database) -> None:
    job_id = submit(api)
    records = synthetic_history(10_000, seed=11)
    write(db, job_id, records, batch=2500)
    page = check_buckets(api, job_id, records, 2)  # width >= 1024: level-1 rollups
    assert page["width"] % rollups.LEVEL_BLOCKS[1] == 0
    check_buckets(api, job_id, records, 3, 77, 9_876)


def test_buckets_are_read_from_the_coarsest_level_whose_blocks_they_are_made_of(
    api: Api, db: Database
) -> None:
    """1000 points over a million steps: the width rounds up to 1024 steps, 16 level-0 blocks
    or one level-1 block; the one block is read (977 rollup rows, not 15,625). A zoom whose
    origin is off the coarser grid stays on the finer one."""
    assert rollups.grid_for(0, 999_999, 1000) == rollups.Grid(origin=0, width=1024, level=1)
    assert rollups.grid_for(64, 999_999, 1000).level == 0
    job_id = submit(api)
    records = synthetic_history(20_000, seed=13)
    write(db, job_id, records, batch=5000)
    page = check_buckets(api, job_id, records, 20)  # 1000 steps a bucket, rounded to 1024
    assert (page["width"], page["origin"]) == (1024, 0)
    check_buckets(api, job_id, records, 20, 64, 19_999)


def test_the_ends_of_a_wide_zoom_come_from_finer_levels_not_from_every_step(
    api: Api, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zoom's ends cover part of a block of the grid's level: they are read from the levels
    below, so at most a level-0 block's worth of step rows at each end. They were read from
    the step rows: up to a whole block of the grid's level (262,143 rows at level 3; 176 ms
    for 3 points over a million steps against 6 ms)."""
    job_id = submit(api)
    records = synthetic_history(20_000, seed=17)
    write(db, job_id, records, batch=5000)
    spans: list[tuple[int, int]] = []
    raw_groups = rollups._raw_groups

    def counted(session: Any, job: int, lo: int, hi: int, grid: rollups.Grid) -> Any:
        spans.append((lo, hi))
        return raw_groups(session, job, lo, hi, grid)

    monkeypatch.setattr(rollups, "_raw_groups", counted)
    for points, lo, hi in ((1, 100, 19_999), (2, 1_000, 18_500), (5, 77, 19_950)):
        assert rollups.grid_for(lo, hi, points).level is not None
        check_buckets(api, job_id, records, points, lo, hi)
    assert spans, "no end was read from the step rows"
    assert all(hi - lo < rollups.LEVEL_BLOCKS[0] for lo, hi in spans), spans


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite has no plan cache
def test_bucket_reads_are_planned_for_their_own_values_however_often_a_connection_runs_them(
    api: Api, db: Database
) -> None:
    """PostgreSQL plans a prepared statement (psycopg prepares one after its fifth run) for
    its values five times, then may keep a generic plan made without them. For the bucket
    queries' lookups of each bucket's last block or step that generic plan scanned the job's
    rows: from the 11th read on one connection, points=1000 over a million steps took ten
    times as long (benchmarks/history.py). Every run is planned for its values."""
    job_id = submit(api)
    records = synthetic_history(20_000, seed=11)
    write(db, job_id, records, batch=5000)
    with db.read() as session:
        for _ in range(15):
            for lo, hi, points in ((0, 19_999, 300), (1000, 1500, 100)):  # rollups, raw rows
                rollups.buckets(session, job_id, lo=lo, hi=hi, points=points)
        plans = session.execute(
            text(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
                "WHERE statement LIKE '%step%'"
            )
        ).all()
    assert plans, "psycopg prepared none of the bucket queries"
    assert [(s, g) for s, g, _ in plans if g] == []
    assert all(custom >= 10 for _, _, custom in plans)


def test_bucket_holding_an_overflow_says_so(api: Api, db: Database) -> None:
    job_id = submit(api)
    records = [StepRecord(s, 0, 1.0, 1024.0, s != 4321) for s in range(10_000)]
    write(db, job_id, records, batch=5000)
    page = api.get(f"/v1/jobs/{job_id}/history?points=3").json()
    flagged = [b for b in page["buckets"] if b["overflow_count"]]
    assert len(flagged) == 1 and flagged[0]["first_step"] <= 4321 <= flagged[0]["last_step"]


def test_rollups_follow_a_truncation_for_resume(api: Api, db: Database, settings: Settings) -> None:
    job_id = submit(api)
    records = synthetic_history(5000, seed=5)
    write(db, job_id, records)
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        history.truncate_after(s, job, 2100)
    kept = records[:2100]
    check_buckets(api, job_id, kept, 4)
    # The resumed attempt writes different values from the cut on.
    resumed = synthetic_history(1500, seed=99, start=2100)
    write(db, job_id, resumed)
    # Written behind the API's back: the bucket page read under the job's snapshot stands
    # until the snapshot ages, as for every poll.
    time.sleep(settings.poll_cache_seconds)
    check_buckets(api, job_id, kept + resumed, 4)
    check_buckets(api, job_id, kept + resumed, 60)
    summary = api.get(f"/v1/jobs/{job_id}").json()["summary"]
    assert summary["last_step"] == 3599
    assert summary["overflow_count"] == sum(1 for r in kept + resumed if not r.finite)


def test_rewriting_a_batch_changes_nothing(api: Api, db: Database) -> None:
    job_id = submit(api)
    records = synthetic_history(1000, seed=8)
    write(db, job_id, records)
    before = api.get(f"/v1/jobs/{job_id}").json()["summary"]
    write(db, job_id, records[200:400])
    after = api.get(f"/v1/jobs/{job_id}").json()["summary"]
    assert after == before
    check_buckets(api, job_id, records, 9)
    with db.read() as s:
        assert s.query(StepRollup).filter_by(job_id=job_id, level=0).count() == math.ceil(1000 / 64)


def test_bucket_response_has_an_etag(api: Api, db: Database) -> None:
    job_id = submit(api)
    write(db, job_id, synthetic_history(100, seed=1))
    r = api.get(f"/v1/jobs/{job_id}/history?points=10")
    again = api.get(
        f"/v1/jobs/{job_id}/history?points=10", headers={"If-None-Match": r.headers["etag"]}
    )
    assert again.status_code == 304


def test_empty_history_gives_no_buckets(api: Api) -> None:
    job_id = submit(api)
    page = api.get(f"/v1/jobs/{job_id}/history?points=10").json()
    assert page["buckets"] == []


def test_bad_zoom_is_422(api: Api) -> None:
    job_id = submit(api)
    r = api.get(f"/v1/jobs/{job_id}/history?points=10&from_step=10&to_step=5")
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "to_step"
    assert api.get(f"/v1/jobs/{job_id}/history?points=0").status_code == 422
    assert api.get(f"/v1/jobs/{job_id}/history?points=100000").status_code == 422


def test_scale_events_are_every_change_with_its_reason(api: Api, db: Database) -> None:
    job_id = submit(api)
    records = synthetic_history(3000, seed=21)
    write(db, job_id, records, batch=333)
    expected = [
        {
            "step": b.step,
            "old_scale": a.loss_scale,
            "new_scale": b.loss_scale,
            "reason": "overflow" if b.loss_scale < a.loss_scale else "growth",
        }
        for a, b in itertools.pairwise(records)
        if a.loss_scale != b.loss_scale
    ]
    assert expected, "the synthetic history should change scale"
    got: list[dict[str, Any]] = []
    after = -1
    while True:
        page = api.get(f"/v1/jobs/{job_id}/loss-scale/events?after_step={after}&limit=7").json()
        got += page["items"]
        after = page["next_after_step"]
        if not page["has_more"]:
            break
    assert got == expected
    assert page["overflow_events"] == sum(1 for e in expected if e["reason"] == "overflow")
    assert page["growth_events"] == sum(1 for e in expected if e["reason"] == "growth")
    summary = api.get(f"/v1/jobs/{job_id}").json()["summary"]
    assert summary["backoff_count"] == page["overflow_events"]
    assert summary["growth_count"] == page["growth_events"]


def test_csv_streams_every_row_and_round_trips_nonfinite_losses(api: Api, db: Database) -> None:
    job_id = submit(api)
    records = synthetic_history(2500, seed=4)
    write(db, job_id, records)
    old_chunk = history_routes.CSV_CHUNK
    history_routes.CSV_CHUNK = 300  # several chunks
    try:
        r = api.get(f"/v1/jobs/{job_id}/history.csv")
    finally:
        history_routes.CSV_CHUNK = old_chunk
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert len(rows) == 2500
    for rec, row in zip(records, rows, strict=True):
        assert int(row["step"]) == rec.step and int(row["epoch"]) == rec.epoch
        loss = float(row["loss"])
        assert (math.isnan(loss) and math.isnan(rec.loss)) or loss == rec.loss
        assert float(row["loss_scale"]) == rec.loss_scale
        assert row["finite"] == ("true" if rec.finite else "false")


def _read_events(lines: Any) -> list[tuple[str, Any]]:
    events = []
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: ") and name is not None:
            events.append((name, json.loads(line[len("data: ") :])))
            name = None
    return events


def test_event_stream_sends_new_steps_and_ends_with_the_job(
    api: Api, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history_routes, "SSE_POLL_SECONDS", 0.05)
    job_id = submit(api)
    records = synthetic_history(120, seed=6)
    write(db, job_id, records[:50])
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.status = "succeeded"
    write(db, job_id, records[50:])
    with api.client.stream(
        "GET", f"/v1/jobs/{job_id}/events?after_step=9", headers=api.headers
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _read_events(r.iter_lines())
    kinds = [k for k, _ in events]
    assert kinds[-1] == "end" and "status" in kinds
    steps = [item["step"] for k, d in events if k == "steps" for item in d["items"]]
    assert steps == list(range(10, 120))


def test_comparison_puts_jobs_on_one_grid(api: Api, db: Database) -> None:
    a, b = submit(api), submit(api)
    ra, rb = synthetic_history(3000, seed=31), synthetic_history(1700, seed=32)
    write(db, a, ra)
    write(db, b, rb)
    r = api.get(f"/v1/history?job_ids={a},{b}&points=40")
    assert r.status_code == 200, r.text
    page = r.json()
    assert (page["from_step"], page["to_step"]) == (0, 2999)
    for entry, records in zip(page["jobs"], (ra, rb), strict=True):
        expected = brute_force(records, 0, 2999, page["origin"], page["width"])
        assert {x["index"]: x for x in entry["buckets"]} == expected
    assert page["jobs"][1]["buckets"][-1]["last_step"] == 1699
    assert api.get("/v1/history?job_ids=1,abc").status_code == 422
    assert api.get(f"/v1/history?job_ids={a},999999").status_code == 404
