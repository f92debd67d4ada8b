"""The job page's metrics per epoch, queue places and who sees cancel and priority, in a real
browser (Debian's Chromium driven by Playwright) against the real app under uvicorn: a real
tiny Keras job's metric charts (each metric with its validation twin, a point per epoch),
read again only when an epoch ends; a queued job's place in the list and on its page; the
actions offered only to the job's owner and admins. SQLite, and PostgreSQL when
HALFWAY_TEST_DATABASE_URL is set.

Set HALFWAY_SCREENSHOT_DIR to keep the screenshots (else they go to the test's temporary
folder)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, expect

from service.api.app import create_app
from service.database.db import Database
from service.database.models import Job
from service.recording import epochmetrics
from service.settings import Settings
from tests.conftest import Api, Team
from tests.test_dashboard import (
    FAST,
    POLLING,
    Dashboard,
    add_job,
    records,
    serve,
    wait_until,
    write,
)
from tests.test_dashboard_panels import new_dashboard, screenshot
from tests.test_training_keras import submit
from workers.supervisor import Supervisor

pytestmark = pytest.mark.browser


@pytest.fixture
def base_url(settings: Settings, db: Database) -> Iterator[str]:
    """The API without a worker: a queued job stays queued."""
    with serve(create_app(settings, db, auth=True)) as url:
        yield url


@pytest.fixture
def dash(browser: Browser, base_url: str) -> Iterator[Dashboard]:
    dashboard = new_dashboard(browser, base_url, 1400, 900)
    yield dashboard
    dashboard.page.context.close()
    assert dashboard.errors == [], "script errors or CSP violations on the page"


def metric_charts(dash: Dashboard) -> list[dict[str, Any]]:
    """Each metric chart's series, its points as the chart holds them (uPlot's own data, read
    back from its canvas' parent) and its x axis title."""
    found: list[dict[str, Any]] = dash.page.eval_on_selector_all(
        "#metric-charts .metric-chart",
        """nodes => nodes.map(n => ({
            series: n.dataset.series,
            points: Number(n.dataset.points),
            x_label: n.dataset.xLabel,
            canvases: n.querySelectorAll("canvas").length,
        }))""",
    )
    return found


def report_epoch(db: Database, job_id: int, epoch: int, loss: float) -> None:
    """What the supervisor's flushes do by an epoch's end: its last step (with the steps
    before it not written yet), then its row and the job's last epoch."""
    last = records(epoch * 10 + 9, 1)
    write(db, job_id, [r._replace(epoch=epoch) for r in last])
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        metrics = {"loss": loss, "val_loss": loss * 1.5}
        epochmetrics.write_epochs(s, job, [epochmetrics.clean_epoch(epoch, metrics)])
        job.metrics = {**job.metrics, "last_epoch": {"epoch": epoch, **metrics}}


# --------------------------------------------------------------------------------------------
# Metrics per epoch


@pytest.mark.keras
def test_a_finished_keras_job_shows_a_chart_per_metric_with_a_point_per_epoch(
    dash: Dashboard, api: Api, db: Database, settings: Settings, team: Team, tmp_path: Path
) -> None:
    job_id = submit(
        api,
        {
            "name": "three-epochs",
            "data": {"kind": "synthetic", "samples": 200, "features": 8, "classes": 3},
            "model": {"input_size": 8, "hidden": [8], "num_classes": 3},
            "training": {"epochs": 3, "batch_size": 16, "validation_split": 0.2},
            "outputs": {"save_model": False},
        },
    )
    assert Supervisor(db, settings).run_once()
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")

    box = dash.page.locator("#epoch-metrics")
    expect(box).to_be_visible()
    expect(dash.page.locator("#metric-charts .metric-chart")).to_have_count(2)
    expect(dash.page.locator('.metric-chart[data-metric="accuracy"]')).to_have_attribute(
        "data-points", "3"
    )
    assert metric_charts(dash) == [
        {"series": "loss,val_loss", "points": 3, "x_label": "epoch", "canvases": 1},
        {"series": "accuracy,val_accuracy", "points": 3, "x_label": "epoch", "canvases": 1},
    ]
    expect(dash.page.locator("#epoch-metrics-caption")).to_contain_text("3 epochs ended")
    # The charts' legends name each series as Keras does.
    legend = dash.page.locator('.metric-chart[data-metric="loss"] .u-legend')
    expect(legend).to_contain_text("val_loss")
    box.scroll_into_view_if_needed()
    screenshot(dash.page, tmp_path, "job-metrics-per-epoch.png")
    # A finished job's metrics are read once, however often the page looks at the job.
    polls = len(dash.requests_to("/v1/jobs"))
    while len(dash.requests_to("/v1/jobs")) < polls + 5:
        dash.page.wait_for_timeout(100)
    assert len(dash.requests_to(f"/v1/jobs/{job_id}/metrics")) == 1


def test_the_metrics_are_read_again_only_when_the_epoch_moves(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="running", status="running", steps_per_epoch=10)
    report_epoch(db, job_id, 0, 2.0)
    dash.open(f"/?token={team.alice}&{FAST}&{POLLING}#job={job_id}")
    chart = dash.page.locator('.metric-chart[data-metric="loss"]')
    expect(chart).to_have_attribute("data-points", "1")
    assert metric_charts(dash)[0]["series"] == "loss,val_loss"
    reads = dash.requests_to(f"/v1/jobs/{job_id}/metrics")
    assert len(reads) == 1

    summary = dash.page.locator("#job-summary")
    # Epoch 1 begins: the job's epoch moved, so the metrics are asked again (nothing new).
    write(db, job_id, [r._replace(epoch=1) for r in records(10, 3)])
    expect(summary).to_contain_text("13 / 1,000")
    wait_until(dash.page, lambda: len(dash.requests_to(f"/v1/jobs/{job_id}/metrics")) == 2)
    # More steps of the same epoch: the job changes, its metrics are not asked for.
    write(db, job_id, [r._replace(epoch=1) for r in records(13, 4)])
    expect(summary).to_contain_text("17 / 1,000")
    write(db, job_id, [r._replace(epoch=1) for r in records(17, 2)])
    expect(summary).to_contain_text("19 / 1,000")
    assert len(dash.requests_to(f"/v1/jobs/{job_id}/metrics")) == 2
    expect(chart).to_have_attribute("data-points", "1")

    report_epoch(db, job_id, 1, 1.0)  # epoch 1 ends (its last step and its metrics)
    expect(chart).to_have_attribute("data-points", "2")
    assert len(dash.requests_to(f"/v1/jobs/{job_id}/metrics")) == 3


def test_a_job_without_an_ended_epoch_shows_no_metric_charts_and_asks_nothing(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="young", status="running")
    write(db, job_id, records(0, 5))
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    expect(dash.page.locator("#loss-chart")).to_have_attribute("data-points", "5")
    expect(dash.page.locator("#epoch-metrics")).to_be_hidden()
    assert not dash.requests_to(f"/v1/jobs/{job_id}/metrics")


# --------------------------------------------------------------------------------------------
# Queue places


def test_queued_jobs_show_their_place_in_the_list_and_on_their_page(
    dash: Dashboard, db: Database, settings: Settings, team: Team, tmp_path: Path
) -> None:
    urgent = add_job(db, settings, name="urgent", owner="bob", status="queued", priority=90)
    waiting = add_job(db, settings, name="waiting", status="queued")
    done = add_job(db, settings, name="done", status="succeeded")
    dash.open(f"/?token={team.alice}&{FAST}#job={waiting}")
    expect(dash.job_row(urgent).locator(".queue-spot")).to_have_text(
        "queued: #1, 0 ahead — next to start"
    )
    expect(dash.job_row(waiting).locator(".queue-spot")).to_have_text(
        "queued: #2, 1 ahead — higher-priority jobs ahead"
    )
    expect(dash.job_row(done).locator(".queue-spot")).to_have_text("")
    state = dash.page.locator("#job-state")
    expect(state).to_contain_text("Queued: #2, 1 ahead — higher-priority jobs ahead")
    expect(state).to_contain_text("waiting for a worker · priority 50")
    screenshot(dash.page, tmp_path, "job-queued-place.png")


# --------------------------------------------------------------------------------------------
# Cancel and priority for whom may use them


@pytest.mark.parametrize(("viewer", "offered"), [("bob", False), ("alice", True), ("admin", True)])
def test_cancel_and_priority_are_offered_only_to_the_owner_and_admins(
    dash: Dashboard, db: Database, settings: Settings, team: Team, viewer: str, offered: bool
) -> None:
    job_id = add_job(db, settings, name="alices", owner="alice", status="queued")
    dash.open(f"/?token={getattr(team, viewer)}&{FAST}#job={job_id}")
    expect(dash.page.locator("#job-state")).to_contain_text("Queued")
    # Decided once /v1/me has answered (until then nothing is offered).
    wait_until(dash.page, lambda: any(url.endswith("/v1/me") for url, _ in dash.responses))
    dash.page.wait_for_timeout(300)
    for control in ("#job-cancel", "#job-priority"):
        if offered:
            expect(dash.page.locator(control)).to_be_visible()
        else:
            expect(dash.page.locator(control)).to_be_hidden()
    assert len(dash.requests_to("/v1/me")) == 1  # once per token, not per poll
