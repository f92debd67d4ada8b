"""The dashboard's gradient band, per-layer table and precision decision in a real browser
(Debian's Chromium driven by Playwright) against the real app under uvicorn, with a real
supervisor running the fake trainer (``tests/fakes.py``: known samples, a known decision, no
TensorFlow); on SQLite, and on PostgreSQL when HALFWAY_TEST_DATABASE_URL is set.

Set HALFWAY_SCREENSHOT_DIR to keep the screenshots the tests take (else they go to the
test's temporary folder)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from playwright.sync_api import Browser, Page, expect

from service.api.app import create_app
from service.database.db import Database
from service.database.models import Job
from service.settings import Settings
from tests.conftest import Team
from tests.test_dashboard import FAST, POLLING, Dashboard, new_context, serve, wait_until
from tests.test_gradient_views import fake_worker
from tests.test_supervisor import make_job

pytestmark = pytest.mark.browser

# 200 steps in batches of 20; a sample every 10 steps (20 of them), the float32 shadow every
# 50 (at 0, 50, 100 and 150); the auto policy's decision first.
SAMPLED: dict[str, Any] = {
    "mode": "succeed",
    "steps": 200,
    "batch": 20,
    "gradients_every": 10,
    "shadow_every": 50,
    "decision": True,
}


@pytest.fixture
def base_url(settings: Settings, db: Database) -> Iterator[str]:
    with serve(create_app(settings, db, auth=True)) as url:
        yield url


@pytest.fixture
def dash(browser: Browser, base_url: str) -> Iterator[Dashboard]:
    context = new_context(browser, height=1400)
    dashboard = Dashboard(context.new_page(), base_url)
    yield dashboard
    context.close()
    assert dashboard.errors == [], "script errors or CSP violations on the page"


def status(db: Database, job_id: int) -> str:
    with db.read() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.status


def trained(db: Database, settings: Settings, page: Page, fake: dict[str, Any]) -> int:
    """A job the fake trainer has run to its end."""
    job_id = make_job(db, fake, name="sampled")
    with fake_worker(db, settings):
        wait_until(page, lambda: status(db, job_id) == "succeeded", timeout=60)
    return job_id


def gradient_queries(dash: Dashboard, job_id: int) -> list[dict[str, str]]:
    """Query parameters of each request for the job's gradient samples, in order."""
    return [
        {k: v[0] for k, v in parse_qs(urlsplit(r.url).query).items()}
        for r in dash.requests_to(f"/v1/jobs/{job_id}/gradients")
    ]


def click_sample(page: Page, step: int, last_step: int) -> None:
    """Click the band where ``step`` is drawn: its x axis spans steps 0..last_step."""
    box = page.locator("#gradient-chart .u-over").bounding_box()
    assert box is not None
    x = box["x"] + box["width"] * step / last_step
    page.mouse.click(x, box["y"] + box["height"] / 2)


def screenshot(page: Page, tmp_path: Path, name: str) -> Path:
    folder = Path(os.environ.get("HALFWAY_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    page.locator("#job").screenshot(path=str(path))
    return path


def test_the_band_draws_every_sample_and_a_click_shows_that_samples_variables(
    dash: Dashboard, db: Database, settings: Settings, team: Team, tmp_path: Path
) -> None:
    job_id = trained(db, settings, dash.page, SAMPLED)
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")

    band = dash.page.locator("#gradient-chart")
    expect(dash.page.locator("#gradients")).to_be_visible()
    expect(band.locator("canvas")).to_have_count(1)
    expect(band).to_have_attribute("data-points", "20")
    expect(band).to_have_attribute("data-shadow-points", "4")
    expect(band).to_have_attribute("data-last-step", "190")
    expect(band.locator(".u-legend")).to_contain_text("underflow share")
    expect(band.locator(".u-legend")).to_contain_text("lost share")
    headroom = dash.page.locator("#headroom-chart")
    expect(headroom.locator("canvas")).to_have_count(1)
    expect(headroom.locator(".u-legend")).to_contain_text("headroom")
    expect(dash.page.locator("#gradient-caption")).to_contain_text(
        "20 samples (4 with the float32 shadow)"
    )
    # Model level, read once, by columns: the variables are read only for a picked sample.
    assert [q.get("format") for q in gradient_queries(dash, job_id)] == ["columns"]

    click_sample(dash.page, 100, 199)
    table = dash.page.locator("#gradient-layers table.layers")
    expect(table).to_have_attribute("data-step", "100")
    expect(band).to_have_attribute("data-picked", "100")  # ringed in the headroom chart
    rows = table.locator("tbody tr")
    expect(rows).to_have_count(3)
    assert rows.evaluate_all("rs => rs.map(r => r.dataset.variable)") == [
        "(model)",
        "dense/kernel",
        "dense/bias",
    ]
    bias = table.locator('tr[data-variable="dense/bias"]')
    expect(bias.locator("td.zero_share")).to_have_text("25%")
    expect(bias.locator("td.log2_max")).to_have_text("2-3")  # 2 with -3 raised
    expect(bias.locator("td.headroom")).to_have_text("18.8 doublings")
    # A shadow sample: what float16 flushes at this scale and what the run lost.
    expect(table.locator('tr[data-variable="(model)"] td.underflow_share')).to_have_text("3.13%")
    expect(table.locator('tr[data-variable="(model)"] td.lost_share')).to_have_text("1.56%")
    expect(table.locator("caption")).to_contain_text("with the float32 shadow")
    picked = gradient_queries(dash, job_id)[-1]
    assert (picked.get("after_step"), picked.get("limit"), picked.get("format")) == (
        "99",
        "1",
        None,
    )
    shot = screenshot(dash.page, tmp_path, "gradient-band-shadow-sample.png")
    assert shot.stat().st_size > 10_000

    # The next sample has no shadow: no shadow columns.
    dash.page.locator("#gradient-layers button.next").click()
    expect(table).to_have_attribute("data-step", "110")
    expect(band).to_have_attribute("data-picked", "110")
    expect(table.locator("td.underflow_share")).to_have_count(0)
    expect(table.locator("caption")).to_contain_text("no float32 shadow at this step")


def test_the_job_panel_shows_the_precision_decision_with_its_probes(
    dash: Dashboard, db: Database, settings: Settings, team: Team, tmp_path: Path
) -> None:
    job_id = trained(db, settings, dash.page, SAMPLED)
    plain = trained(db, settings, dash.page, {"mode": "succeed", "steps": 20})
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")

    decision = dash.page.locator("#job-decision")
    expect(decision).to_be_visible()
    expect(decision.locator(".chosen-policy")).to_have_text("mixed_float16")
    expect(decision.locator(".reason")).to_have_text(
        "fake: the fastest candidate whose loss tracks float32's"
    )
    probes = decision.locator("table.probes tbody tr")
    expect(probes).to_have_count(3)
    assert probes.evaluate_all("rs => rs.map(r => r.dataset.policy)") == [
        "float32",
        "mixed_bfloat16",
        "mixed_float16",
    ]
    expect(decision.locator("tr.chosen")).to_have_attribute("data-policy", "mixed_float16")
    expect(decision.locator('tr[data-policy="float32"] td')).to_have_text(
        ["float32", "4.00", "0.5", "0", "0 / 20", "0%", "0%", "yes", "within tolerance"]
    )
    screenshot(dash.page, tmp_path, "precision-decision.png")

    # A job without samples or a decision: neither shows, and its samples are never asked.
    dash.job_row(plain).click()
    expect(dash.page.locator("#job-title")).to_contain_text(f"#{plain}")
    expect(dash.page.locator("#loss-chart")).to_have_attribute("data-points", "20")
    expect(decision).to_be_hidden()
    expect(dash.page.locator("#gradients")).to_be_hidden()
    assert gradient_queries(dash, plain) == []


def test_a_job_selected_again_shows_its_band_and_decision_without_reading_them_again(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    """Polled, a job selected again answers 304 and is not redrawn: what the band held must
    still be there, not read again."""
    job_id = trained(db, settings, dash.page, SAMPLED)
    dash.open(f"/?token={team.alice}&{FAST}&{POLLING}#job={job_id}")
    band = dash.page.locator("#gradient-chart")
    expect(band).to_have_attribute("data-points", "20")
    expect(dash.page.locator("#job-decision")).to_be_visible()

    dash.page.evaluate("location.hash = ''")
    expect(dash.page.locator("#job")).to_be_hidden()
    polls = len(dash.job_polls(job_id))
    dash.job_row(job_id).click()
    wait_until(dash.page, lambda: len(dash.job_polls(job_id)) > polls)
    expect(dash.page.locator("#gradients")).to_be_visible()
    expect(band).to_have_attribute("data-points", "20")
    expect(dash.page.locator("#job-decision")).to_be_visible()
    assert len(gradient_queries(dash, job_id)) == 1


@pytest.mark.parametrize("transport", ["stream", "poll"])
def test_samples_are_read_after_a_cursor_and_again_from_the_start_after_a_resume(
    dash: Dashboard, db: Database, settings: Settings, team: Team, transport: str
) -> None:
    """Attempt 1 samples steps 0..99 every 10, checkpoints at 60 and waits, then is killed;
    attempt 2 resumes at 60 and samples on to 149 (the fake's zero share doubles in it).
    Streamed or polled, the page reads only new samples while the job runs, nothing while it
    does not change, and everything again once history_version moves."""
    crash = settings.resolved_data_dir() / "crash-now"
    plan = [
        {
            "until": 100,
            "total": 150,
            "checkpoint_at": 60,
            "wait_for": crash.name,
            "then": "crash",
            "gradients_every": 10,
        },
        {"until": 150, "gradients_every": 10},
    ]
    job_id = make_job(db, {"mode": "plan", "plan": plan}, name="resumed")
    with fake_worker(db, settings):
        polling = f"&{POLLING}" if transport == "poll" else ""
        dash.open(f"/?token={team.alice}&{FAST}{polling}#job={job_id}")
        band = dash.page.locator("#gradient-chart")
        expect(band).to_have_attribute("data-points", "10", timeout=30_000)
        expect(band).to_have_attribute("data-history-version", "0")
        asked = len(gradient_queries(dash, job_id))
        # The job is waiting and unchanged: polls of it cost 304s (or the stream is silent),
        # and no sample is asked.
        if transport == "poll":
            polls = len(dash.job_polls(job_id))
            wait_until(dash.page, lambda: len(dash.job_polls(job_id)) >= polls + 4)
        else:
            dash.page.wait_for_timeout(1000)
            assert len(dash.streams(job_id)) == 1
        assert len(gradient_queries(dash, job_id)) == asked

        crash.touch()
        expect(dash.job_row(job_id).locator(".status")).to_have_text("succeeded", timeout=60_000)
        expect(band).to_have_attribute("data-points", "15")
        expect(band).to_have_attribute("data-history-version", "1")
    cursors = [int(q["after_step"]) for q in gradient_queries(dash, job_id)]
    assert cursors[0] == -1 and -1 in cursors[1:], cursors
    restart = cursors.index(-1, 1)  # read again from the start once the version moved
    # Before it, each read went on from the last sample held, never back.
    assert cursors[:restart] == sorted(set(cursors[:restart])), cursors
    assert all(c % 10 == 0 for c in cursors[1:restart]), cursors

    click_sample(dash.page, 80, 149)
    table = dash.page.locator("#gradient-layers table.layers")
    expect(table).to_have_attribute("data-step", "80")
    # Attempt 2's sample, not attempt 1's replaced one.
    expect(table.locator('tr[data-variable="(model)"] td.zero_share')).to_have_text("1.56%")
