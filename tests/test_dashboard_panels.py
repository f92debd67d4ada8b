"""The job page's state line, panels and actions in a real browser (Debian's Chromium driven by
Playwright) against the real app under uvicorn: a failed job's error and its log, the live
log, the spec and attempts panels, cancel and priority with a confirmation, a comparison
link opened cold, labels and numbers for people, and both charts in view at 1400x900; on
SQLite, and on PostgreSQL when HALFWAY_TEST_DATABASE_URL is set.

Set HALFWAY_SCREENSHOT_DIR to keep the screenshots the tests take (else they go to the
test's temporary folder)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from service.api.app import create_app
from service.database.db import Database
from service.files.storage import open_storage
from service.settings import Settings
from tests.conftest import Team
from tests.test_dashboard import (
    FAST,
    Dashboard,
    add_job,
    drag,
    new_context,
    records,
    serve,
    wait_until,
    write,
)
from tests.test_gradient_dashboard import status
from tests.test_gradient_views import fake_worker
from tests.test_supervisor import make_job

pytestmark = pytest.mark.browser

NBSP = "\u00a0"


@pytest.fixture
def base_url(settings: Settings, db: Database) -> Iterator[str]:
    with serve(create_app(settings, db, auth=True)) as url:
        yield url


def new_dashboard(browser: Browser, base_url: str, width: int, height: int) -> Dashboard:
    return Dashboard(new_context(browser, width=width, height=height).new_page(), base_url)


@pytest.fixture
def dash(browser: Browser, base_url: str) -> Iterator[Dashboard]:
    dashboard = new_dashboard(browser, base_url, 1400, 900)
    yield dashboard
    dashboard.page.context.close()
    assert dashboard.errors == [], "script errors or CSP violations on the page"


def put_log(settings: Settings, job_id: int, text: str) -> None:
    """The job's training log, where the worker leaves it (the artifact store)."""
    store = open_storage(settings.storage_config()).artifacts
    store.put_bytes(f"{job_id}/train.log", text.encode())


def job_json(base_url: str, token: str, job_id: int) -> dict[str, Any]:
    response = httpx.get(f"{base_url}/v1/jobs/{job_id}", headers=Team.header(token))
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def screenshot(page: Page, tmp_path: Path, name: str) -> Path:
    folder = Path(os.environ.get("HALFWAY_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    page.screenshot(path=str(path))
    return path


# --------------------------------------------------------------------------------------------
# A job that does not train says so; its log is one click away


def test_a_failed_job_shows_its_error_in_the_chart_area_and_a_link_that_opens_its_log(
    dash: Dashboard,
    browser: Browser,
    db: Database,
    settings: Settings,
    team: Team,
    tmp_path: Path,
) -> None:
    job_id = add_job(
        db,
        settings,
        name="broken",
        status="failed",
        error="ValueError: the dataset is empty (the full traceback is in the job's log)",
        attempt_errors=[{"attempt": 1, "error": "worker lost (lease expired)"}],
    )
    put_log(settings, job_id, "epoch 1 starting\nTraceback (most recent call last):\nBOOM\n")
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")

    state = dash.page.locator("#job-state")
    expect(state).to_be_visible()
    expect(state).to_contain_text("Failed")
    expect(state.locator("pre.error")).to_have_text(
        "ValueError: the dataset is empty (the full traceback is in the job's log)"
    )
    # No step was recorded: no two empty charts.
    expect(dash.page.locator("#job-charts")).to_be_hidden()
    # Panels are closed until asked for, and cost no request then.
    expect(dash.page.locator("#job-panel")).to_be_hidden()
    assert not dash.requests_to(f"/v1/jobs/{job_id}/logs")

    dash.page.locator("#job-state a.open-log").click()
    expect(dash.page.locator("#job-panel")).to_have_attribute("data-tab", "log")
    expect(dash.page.locator("#job-log")).to_contain_text("Traceback (most recent call last):")
    expect(dash.page.locator("#job-log")).to_contain_text("BOOM")
    assert "tab=log" in dash.page.url
    screenshot(dash.page, tmp_path, "job-failed.png")

    # The attempt history is a panel too.
    dash.page.locator('#job-tabs .tab[data-tab="attempts"]').click()
    expect(dash.page.locator("#job-panel")).to_contain_text("worker lost (lease expired)")
    # The failed job's log link, opened cold, opens the log at once.
    other = new_dashboard(browser, dash.base_url, 1400, 900)
    try:
        other.open(f"/?token={team.alice}&{FAST}#job={job_id}&tab=log")
        expect(other.page.locator("#job-log")).to_contain_text("BOOM")
        assert other.errors == []
    finally:
        other.page.context.close()


def test_a_queued_job_says_it_waits_instead_of_drawing_empty_charts(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="waiting", status="queued")
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    expect(dash.page.locator("#job-state")).to_contain_text("Queued")
    expect(dash.page.locator("#job-charts")).to_be_hidden()


# --------------------------------------------------------------------------------------------
# Panels


def test_the_log_panel_shows_the_log_and_appends_what_the_running_job_writes(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="chatty", status="running")
    first = "line one\nline two\n"
    put_log(settings, job_id, first)
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    dash.page.locator('#job-tabs .tab[data-tab="log"]').click()
    log = dash.page.locator("#job-log")
    expect(log).to_have_text(first)
    expect(log).to_have_attribute("data-offset", str(len(first)))

    put_log(settings, job_id, first + "line three\n")
    expect(log).to_have_text(first + "line three\n")
    # After the first read, only what follows the offset the server gave is asked for.
    queries = [parse_qs(urlsplit(r.url).query) for r in dash.requests_to(f"/v1/jobs/{job_id}/logs")]
    assert "tail" in queries[0]
    assert ["offset" in q for q in queries[1:]] == [True] * (len(queries) - 1)
    assert queries[1]["offset"] == [str(len(first))]

    # Closing the panel stops the reads.
    dash.page.locator('#job-tabs .tab[data-tab="log"]').click()
    expect(dash.page.locator("#job-panel")).to_be_hidden()
    asked = len(dash.requests_to(f"/v1/jobs/{job_id}/logs"))
    dash.page.wait_for_timeout(800)
    assert len(dash.requests_to(f"/v1/jobs/{job_id}/logs")) == asked


def test_the_spec_panel_shows_the_normalized_spec_as_json(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="specced", status="succeeded")
    spec = job_json(dash.base_url, team.alice, job_id)["spec"]
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}&tab=spec")
    expect(dash.page.locator("#job-panel pre.json")).to_contain_text('"name": "specced"')
    shown = dash.page.locator("#job-panel pre.json").text_content()
    assert json.loads(shown or "") == spec


def test_the_artifacts_panel_lists_the_files_and_downloads_one_with_the_token(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="saved", status="succeeded")
    store = open_storage(settings.storage_config()).artifacts
    store.put_bytes(f"{job_id}/model.keras", b"not really a model")
    put_log(settings, job_id, "done\n")
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    assert not dash.requests_to(f"/v1/jobs/{job_id}/artifacts")  # closed: never asked

    dash.page.locator('#job-tabs .tab[data-tab="artifacts"]').click()
    links = dash.page.locator("#job-artifacts a.artifact")
    expect(links).to_have_text(["model.keras", "train.log"])
    with dash.page.expect_download() as info:
        links.first.click()
    download = info.value
    assert download.suggested_filename == f"job-{job_id}-model.keras"
    assert Path(download.path()).read_bytes() == b"not really a model"


# --------------------------------------------------------------------------------------------
# Actions


def test_a_cancel_from_the_dashboard_cancels_a_queued_job(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="not-needed", status="queued")
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    cancel = dash.page.locator("#job-cancel")
    expect(cancel).to_be_visible()
    cancel.click()
    # Nothing happens before the confirmation.
    expect(dash.page.locator("#job-confirm")).to_be_visible()
    expect(dash.page.locator("#job-confirm-text")).to_contain_text(f"#{job_id}")
    assert not [r for r in dash.requests if r.method == "POST"]
    dash.page.locator("#job-confirm-yes").click()

    expect(dash.page.locator("#job-status")).to_have_text("cancelled")
    assert job_json(dash.base_url, team.alice, job_id)["status"] == "cancelled"
    expect(cancel).to_be_hidden()


def test_a_cancel_from_the_dashboard_asks_a_running_jobs_worker_to_stop(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="long", status="running")
    write(db, job_id, records(0, 50))
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    dash.page.locator("#job-cancel").click()
    # "No" leaves the job alone.
    dash.page.locator("#job-confirm-no").click()
    expect(dash.page.locator("#job-confirm")).to_be_hidden()
    assert job_json(dash.base_url, team.alice, job_id)["cancel_requested"] is False

    dash.page.locator("#job-cancel").click()
    dash.page.locator("#job-confirm-yes").click()
    expect(dash.page.locator("#job-state")).to_contain_text("Cancelling")
    assert job_json(dash.base_url, team.alice, job_id)["cancel_requested"] is True


def test_a_cancel_from_the_dashboard_stops_a_job_a_real_worker_is_running(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    """End to end: a supervisor runs the fake trainer (a child that would train for an hour);
    the dashboard's cancel reaches it and the job ends cancelled."""
    job_id = make_job(db, {"mode": "hang"}, name="endless")
    with fake_worker(db, settings):
        wait_until(dash.page, lambda: status(db, job_id) == "running", timeout=60)
        dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
        expect(dash.page.locator("#job-status")).to_have_text("running")
        dash.page.locator("#job-cancel").click()
        dash.page.locator("#job-confirm-yes").click()
        wait_until(dash.page, lambda: status(db, job_id) == "cancelled", timeout=60)
    assert job_json(dash.base_url, team.alice, job_id)["status"] == "cancelled"
    expect(dash.page.locator("#job-status")).to_have_text("cancelled")
    expect(dash.page.locator("#job-state")).to_contain_text("Cancelled")


def test_another_users_job_offers_no_cancel_and_the_server_would_refuse_one(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="alices", owner="alice", status="queued")
    dash.open(f"/?token={team.bob}&{FAST}#job={job_id}")
    expect(dash.page.locator("#job-state")).to_contain_text("Queued")
    wait_until(dash.page, lambda: any(url.endswith("/v1/me") for url, _ in dash.responses))
    expect(dash.page.locator("#job-cancel")).to_be_hidden()
    expect(dash.page.locator("#job-priority")).to_be_hidden()
    # Hiding the button is a courtesy: the server is what refuses.
    refused = httpx.post(f"{dash.base_url}/v1/jobs/{job_id}/cancel", headers=Team.header(team.bob))
    assert refused.status_code == 403
    assert job_json(dash.base_url, team.alice, job_id)["status"] == "queued"


def test_a_queued_jobs_priority_changes_after_a_confirmation(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="urgent", status="queued")
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    dash.page.locator("#job-priority-value").fill("90")
    dash.page.locator("#job-priority button[type=submit]").click()
    expect(dash.page.locator("#job-confirm-text")).to_contain_text("to 90")
    dash.page.locator("#job-confirm-yes").click()
    expect(dash.page.locator("#job-action-note")).to_contain_text("Priority is now 90")
    assert job_json(dash.base_url, team.alice, job_id)["priority"] == 90


# --------------------------------------------------------------------------------------------
# Comparison in the address


def test_a_compare_link_opened_cold_shows_the_same_jobs_and_zoom(
    dash: Dashboard,
    browser: Browser,
    db: Database,
    settings: Settings,
    team: Team,
    tmp_path: Path,
) -> None:
    first = add_job(db, settings, name="fp16-run", status="succeeded")
    write(db, first, records(0, 600, overflow_at=[100, 200]))
    second = add_job(db, settings, name="bf16-run", status="succeeded")
    write(db, second, records(0, 900))
    third = add_job(db, settings, name="not-compared", status="succeeded")

    dash.open(f"/?token={team.alice}&{FAST}")
    dash.job_row(first).locator(".compare-box").check()
    dash.job_row(second).locator(".compare-box").check()
    expect(dash.page.locator("#compare-loss-chart")).to_have_attribute(
        "data-jobs", f"{first},{second}"
    )
    wait_until(dash.page, lambda: f"compare={first},{second}" in dash.page.url)

    # Cold: another browser context (no state shared), the same link plus a zoom.
    link = dash.page.url + "&compare_steps=100-400"
    other = new_dashboard(browser, dash.base_url, 1400, 900)
    try:
        other.open("/?token=" + team.alice)  # the token, as a first visit
        other.page.goto(link)
        expect(other.page.locator("#compare")).to_be_visible()
        expect(other.page.locator("#compare-loss-chart")).to_have_attribute(
            "data-jobs", f"{first},{second}"
        )
        expect(other.job_row(first).locator(".compare-box")).to_be_checked()
        expect(other.job_row(second).locator(".compare-box")).to_be_checked()
        expect(other.job_row(third).locator(".compare-box")).not_to_be_checked()
        expect(other.page.locator("#compare-note")).to_contain_text("steps 100\u2013400")
        asked = [r.url for r in other.requests if urlsplit(r.url).path == "/v1/history"]
        query = parse_qs(urlsplit(asked[-1]).query)
        assert query["job_ids"] == [f"{first},{second}"]
        assert (query["from_step"], query["to_step"]) == (["100"], ["400"])
        screenshot(other.page, tmp_path, "compare-cold.png")

        # A zoom made on the page goes into the address too, ready to be shared.
        other.page.locator("#compare").scroll_into_view_if_needed()
        drag(other.page, "#compare-loss-chart", 0.25, 0.75)

        def steps_in_address() -> str:
            return parse_qs(urlsplit(other.page.url).fragment)["compare_steps"][0]

        wait_until(other.page, lambda: steps_in_address() != "100-400")
        steps = steps_in_address()
        low, high = (int(x) for x in steps.split("-"))
        assert 100 <= low < high <= 400
        assert other.errors == []
    finally:
        other.page.context.close()


# --------------------------------------------------------------------------------------------
# Layout and numbers


def test_at_1400x900_both_charts_are_in_view_with_an_x_axis_title(
    dash: Dashboard, db: Database, settings: Settings, team: Team, tmp_path: Path
) -> None:
    for i in range(12):  # a list long enough to push the charts down if it could
        add_job(db, settings, name=f"other-{i}", status="succeeded")
    job_id = add_job(
        db,
        settings,
        name="in-view",
        status="failed",
        error="guard: too many overflows",
    )
    write(db, job_id, records(0, 400, overflow_at=[50, 300]))
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    expect(dash.page.locator("#loss-chart")).to_have_attribute("data-points", "400")
    expect(dash.page.locator("#scale-chart canvas")).to_have_count(1)
    assert dash.page.evaluate("window.scrollY") == 0
    for chart in ("#loss-chart", "#scale-chart"):
        box = dash.page.locator(chart).bounding_box()
        assert box is not None
        assert box["y"] >= 0 and box["y"] + box["height"] <= 900, (chart, box)
        assert box["x"] >= 0 and box["x"] + box["width"] <= 1400, (chart, box)
        expect(dash.page.locator(chart)).to_have_attribute("data-x-label", "step")
    screenshot(dash.page, tmp_path, "job-charts-1400x900.png")


def test_metrics_have_human_labels_and_numbers_and_the_epochs_agree(
    dash: Dashboard, db: Database, settings: Settings, team: Team, tmp_path: Path
) -> None:
    job_id = add_job(
        db,
        settings,
        name="measured",
        status="succeeded",
        metrics={
            "last_epoch": {"epoch": 3, "accuracy": 0.875, "val_loss": 0.4321},
            "timing": {
                "median_step_seconds": 0.0123,
                "examples_per_second": 18654.25,
                "peak_memory_bytes": 3 * 2**20,
            },
        },
        steps_per_second=1234.5,
    )
    # The step record's epoch counts from 0, as Keras does: 3 is the fourth.
    write(db, job_id, [row._replace(epoch=3) for row in records(0, 20)])
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    metrics = dash.page.locator("#job-metrics")
    expect(metrics.locator("dt")).to_have_text(
        [
            "Last epoch",
            "Epoch",
            "Accuracy",
            "Validation loss",
            "Timing",
            "Median step",
            "Examples/s",
            "Peak memory",
        ]
    )
    expect(metrics.locator("dd")).to_have_text(
        ["4", "0.875", "0.4321", f"12.3{NBSP}ms", f"18,654{NBSP}/s", f"3.0{NBSP}MiB"]
    )
    # The summary's epoch counts from 1 as the metrics' does.
    summary = dash.page.locator("#job-summary")
    epoch = summary.locator("dt", has_text="Epoch").locator("xpath=following-sibling::dd[1]")
    planned = job_json(dash.base_url, team.alice, job_id)["spec"]["training"]["epochs"]
    expect(epoch).to_have_text(f"4 of {planned}")
    expect(summary).to_contain_text("1,234.5")
    # A value never wraps inside itself: each is one line high.
    for dd in metrics.locator("dd").all():
        box = dd.bounding_box()
        assert box is not None and box["height"] < 24, dd.text_content()
    screenshot(dash.page, tmp_path, "job-succeeded.png")
