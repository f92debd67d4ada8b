"""Whole runs in columns: ``history?format=columns``, ``history.arrow`` and
``history.parquet`` give back every row that was written (NaN and infinite losses, skipped
updates, a resumed job's rewritten range, gaps), in step order, on SQLite and PostgreSQL;
bad ranges are 422s; and pyarrow is loaded only by the first export."""

from __future__ import annotations

import io
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.responses import ColumnsPage, HistoryPage
from service.database.db import Database
from service.database.models import Job, float32
from service.recording import columnar, history
from service.recording.records import StepRecord
from service.settings import Settings
from tests.conftest import Api, Team
from tests.test_history_queries import submit, synthetic_history, write
from tests.test_server_process import start_server, stop_server


def as_tuples(records: list[StepRecord]) -> list[tuple[Any, ...]]:
    """Rows as comparable tuples: NaN as the string "nan" (NaN never equals itself)."""
    return [
        (r.step, r.epoch, "nan" if math.isnan(r.loss) else r.loss, r.loss_scale, r.finite)
        for r in records
    ]


def table_tuples(table: Any) -> list[tuple[Any, ...]]:
    cols = table.to_pydict()
    return as_tuples(
        [
            StepRecord(*row)
            for row in zip(
                cols["step"],
                cols["epoch"],
                cols["loss"],
                cols["loss_scale"],
                cols["finite"],
                strict=True,
            )
        ]
    )


def page_tuples(page: dict[str, Any]) -> list[tuple[Any, ...]]:
    """A ColumnsPage's rows, its non-finite losses restored from ``loss_nonfinite``."""
    nonfinite = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
    losses = [
        nonfinite[flag] if flag is not None else loss
        for loss, flag in zip(page["loss"], page["loss_nonfinite"], strict=True)
    ]
    assert all(
        (loss is None) == (flag is not None)
        for loss, flag in zip(page["loss"], page["loss_nonfinite"], strict=True)
    )
    return as_tuples(
        [
            StepRecord(*row)
            for row in zip(
                page["step"], page["epoch"], losses, page["loss_scale"], page["finite"], strict=True
            )
        ]
    )


def all_columns(api: Api, job_id: int, limit: int) -> list[tuple[Any, ...]]:
    """Every row through format=columns pages of ``limit`` rows, by the cursor."""
    rows: list[tuple[Any, ...]] = []
    after = -1
    while True:
        r = api.get(f"/v1/jobs/{job_id}/history?format=columns&after_step={after}&limit={limit}")
        assert r.status_code == 200, r.text
        page = r.json()
        ColumnsPage.model_validate(page)  # the hand-built JSON keeps the documented shape
        assert len(page["step"]) <= limit
        rows += page_tuples(page)
        assert page["next_after_step"] >= after
        after = page["next_after_step"]
        if not page["has_more"]:
            return rows


def arrow_table(api: Api, job_id: int, query: str = "") -> Any:
    r = api.get(f"/v1/jobs/{job_id}/history.arrow{query}")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == columnar.ARROW_MEDIA_TYPE
    assert "content-encoding" not in r.headers  # not gzipped
    return pa.ipc.open_stream(r.content).read_all()


def parquet_table(api: Api, job_id: int, query: str = "") -> Any:
    r = api.get(f"/v1/jobs/{job_id}/history.parquet{query}")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == columnar.PARQUET_MEDIA_TYPE
    assert "content-encoding" not in r.headers
    return pq.read_table(io.BytesIO(r.content))


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exports in many chunks (record batches, row groups, transactions)."""
    monkeypatch.setattr(columnar, "CHUNK_ROWS", 700)


def test_every_format_round_trips_every_row_of_a_resumed_job(
    api: Api, db: Database, small_chunks: None
) -> None:
    job_id = submit(api)
    first = synthetic_history(5000, seed=5)
    write(db, job_id, first)
    with db.write() as s:  # a resume from step 2100: the rest is written again, differently
        job = s.get(Job, job_id)
        assert job is not None
        history.truncate_after(s, job, 2100)
    records = first[:2100] + synthetic_history(1500, seed=99, start=2100)
    write(db, job_id, records[2100:])
    assert any(math.isnan(r.loss) for r in records) and any(not r.finite for r in records)
    assert {math.inf, -math.inf} <= {r.loss for r in records}
    assert records[2100:2200] != first[2100:2200]
    expected = as_tuples(records)

    assert all_columns(api, job_id, limit=1_000_000) == expected
    assert all_columns(api, job_id, limit=333) == expected
    arrow = arrow_table(api, job_id)
    assert table_tuples(arrow) == expected
    assert len(arrow.to_batches()) == math.ceil(len(records) / 700)
    assert arrow.schema.field("loss").type == pa.float32()
    assert arrow.schema.metadata[b"halfway.job_id"] == str(job_id).encode()
    parquet = parquet_table(api, job_id)
    assert table_tuples(parquet) == expected
    assert parquet.schema.remove_metadata() == arrow.schema.remove_metadata()


def test_columns_equal_the_row_pages(api: Api, db: Database) -> None:
    job_id = submit(api)
    write(db, job_id, synthetic_history(1200, seed=3))
    rows = api.get(f"/v1/jobs/{job_id}/history?after_step=99&limit=500").json()
    HistoryPage.model_validate(rows)
    cols = api.get(f"/v1/jobs/{job_id}/history?format=columns&after_step=99&limit=500").json()
    for field in ("step", "epoch", "loss", "loss_nonfinite", "loss_scale", "finite"):
        assert cols[field] == [item[field] for item in rows["items"]], field
    assert (cols["next_after_step"], cols["has_more"]) == (599, True)
    assert (rows["next_after_step"], rows["has_more"]) == (599, True)


def test_ranges_select_steps_and_a_gap_is_crossed_in_one_page(
    api: Api, db: Database, small_chunks: None
) -> None:
    job_id = submit(api)
    # Steps 0..999, then none until 5,000,000 (a history with a hole; a cursor must not
    # crawl through five million empty steps).
    records = synthetic_history(1000, seed=1) + synthetic_history(1000, seed=2, start=5_000_000)
    write(db, job_id, records)
    expected = as_tuples(records)
    assert all_columns(api, job_id, limit=400) == expected
    page = api.get(f"/v1/jobs/{job_id}/history?format=columns&after_step=800&limit=400").json()
    assert page["step"] == list(range(801, 1000))
    assert (page["next_after_step"], page["has_more"]) == (4_999_999, True)
    assert table_tuples(arrow_table(api, job_id)) == expected
    between = "?from_step=990&to_step=5000009"
    want = [t for t in expected if 990 <= t[0] <= 5_000_009]
    assert table_tuples(arrow_table(api, job_id, between)) == want
    assert table_tuples(parquet_table(api, job_id, between)) == want
    only = "?from_step=100&to_step=100"
    assert table_tuples(parquet_table(api, job_id, only)) == [expected[100]]
    assert arrow_table(api, job_id, "?from_step=2000&to_step=3000").num_rows == 0


def test_an_empty_history_is_an_empty_table_in_every_format(api: Api) -> None:
    job_id = submit(api)
    page = api.get(f"/v1/jobs/{job_id}/history?format=columns").json()
    assert page["step"] == [] and page["has_more"] is False and page["next_after_step"] == -1
    assert arrow_table(api, job_id).num_rows == 0
    parquet = parquet_table(api, job_id)
    assert parquet.num_rows == 0 and parquet.column_names == [
        "step",
        "epoch",
        "loss",
        "loss_scale",
        "finite",
    ]


def test_exports_refuse_bad_ranges_and_unknown_jobs(api: Api) -> None:
    job_id = submit(api)
    for suffix in (".arrow", ".parquet"):
        r = api.get(f"/v1/jobs/{job_id}/history{suffix}?from_step=10&to_step=5")
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "to_step"
        r = api.get(f"/v1/jobs/{job_id}/history{suffix}?from_step=-1")
        assert r.status_code == 422 and r.json()["fields"][0]["field"] == "query.from_step"
        assert api.get(f"/v1/jobs/999999/history{suffix}").status_code == 404
    r = api.get(f"/v1/jobs/{job_id}/history?limit=10001")
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "query.limit"
    r = api.get(f"/v1/jobs/{job_id}/history?format=columns&limit=1000001")
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "query.limit"
    r = api.get(f"/v1/jobs/{job_id}/history?format=csv")
    assert r.status_code == 422 and r.json()["fields"][0]["field"] == "query.format"
    assert api.get("/v1/jobs/999999/history?format=columns").status_code == 404


def test_a_polled_columns_page_stops_at_the_snapshot_and_is_shared(
    settings: Settings, db: Database, team: Team
) -> None:
    settings.poll_cache_seconds = 60  # the snapshot never expires during this test
    with TestClient(create_app(settings, db, auth=True)) as client:
        api = Api(client, team.alice)
        job_id = submit(api)
        write(db, job_id, [StepRecord(s, 0, 0.5, 1024.0, True) for s in range(10)])
        assert api.get(f"/v1/jobs/{job_id}").json()["summary"]["last_step"] == 9
        at_end = api.get(f"/v1/jobs/{job_id}/history?format=columns&after_step=9").json()
        assert at_end["step"] == [] and at_end["next_after_step"] == 9
        write(db, job_id, [StepRecord(s, 0, 0.25, 1024.0, True) for s in range(10, 20)])
        url = f"/v1/jobs/{job_id}/history?format=columns&after_step=4"
        first = api.get(url)
        assert first.json()["step"] == [5, 6, 7, 8, 9]  # cut at the snapshot's last step
        again = api.get(url, headers={"If-None-Match": first.headers["etag"]})
        assert again.status_code == 304
        rows = api.get(f"/v1/jobs/{job_id}/history?after_step=4").json()
        assert [item["step"] for item in rows["items"]] == [5, 6, 7, 8, 9]


def test_float32_values_come_back_exactly(api: Api, db: Database) -> None:
    job_id = submit(api)
    values = [float32(v) for v in (0.1, 1 / 3, 2.0**-20, 3.4e38, 1e-45, 65504.0)]
    write(db, job_id, [StepRecord(i, 0, v, v, True) for i, v in enumerate(values)])
    assert arrow_table(api, job_id).column("loss").to_pylist() == values
    page = api.get(f"/v1/jobs/{job_id}/history?format=columns").json()
    assert page["loss"] == values and page["loss_scale"] == values


def test_the_api_loads_pyarrow_only_for_the_first_export(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from service.api.app import create_app\n"
        "from service.database.db import Database\n"
        "from service.settings import Settings\n"
        f"s = Settings(home={str(tmp_path)!r})\n"
        f"create_app(s, Database.connect('sqlite:///{tmp_path / 'x.db'}'))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyarrow'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr

    server = start_server(tmp_path, "--no-worker")
    try:
        maps = Path(f"/proc/{server.process.pid}/maps")
        assert "libarrow" not in maps.read_text()
        headers = server.headers
        job_id = httpx.post(f"{server.url}/v1/jobs", json={}, headers=headers).json()["id"]
        r = httpx.get(f"{server.url}/v1/jobs/{job_id}/history.arrow", headers=headers)
        assert r.status_code == 200, r.text
        assert pa.ipc.open_stream(r.content).read_all().num_rows == 0
        assert "libarrow" in maps.read_text()
    finally:
        stop_server(server)
