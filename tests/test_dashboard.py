"""The dashboard in a real browser (Debian's Chromium driven by Playwright) against the real
app served by uvicorn: the token link, the job list, charts with every overflow marked, live
updates through the job's event stream and, when that fails or with ?stream=0, by polling
with a cursor, buckets for long runs and zoom, comparison, HTML injection and 401s; on
SQLite, and on PostgreSQL when HALFWAY_TEST_DATABASE_URL is set."""

from __future__ import annotations

import math
import re
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from playwright.sync_api import (
    Browser,
    BrowserContext,
    Page,
    Request,
    Response,
    Route,
    expect,
)
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from service.api.app import create_app
from service.api.routes.dashboard import STATIC
from service.database.db import Database
from service.database.models import Job, utcnow
from service.recording import history
from service.recording.records import StepRecord
from service.scheduling import jobs
from service.settings import Settings
from service.specs import normalization
from service.specs.schemas import JobSpec
from tests import fakes
from tests.conftest import Team
from tests.test_supervisor import make_job
from workers.supervisor import Supervisor

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
FAST = "poll_ms=200"  # the page polls every 2 s by default; tests need not wait that long
POLLING = "stream=0"  # the page polls the selected job instead of listening to its stream
PAYLOAD = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
SHORT_PAYLOAD = '<img src=x onerror="window.__pwned=3">'  # fits the 64-character owner

pytestmark = pytest.mark.browser


# --------------------------------------------------------------------------------------------
# The server, the browser, and a page that records what it asked the API


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """The app on a real socket (uvicorn in a thread), as a browser would reach it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound before uvicorn starts: no race for the port
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def base_url(settings: Settings, db: Database) -> Iterator[str]:
    with serve(create_app(settings, db, auth=True)) as url:
        yield url


class Dashboard:
    """One browser tab on the dashboard. Records every API request (URL, status, headers)
    and every script error or Content-Security-Policy violation."""

    def __init__(self, page: Page, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
        self.pending: dict[Request, str] = {}  # every request not yet answered, any path
        self.requests: list[Request] = []
        self.responses: list[tuple[str, int]] = []
        self.event_streams: list[str] = []  # URLs answered 200 with an event stream
        self.errors: list[str] = []
        page.on("request", self._on_request)
        page.on("response", self._on_response)
        page.on("requestfinished", self._on_answered)
        page.on("requestfailed", self._on_answered)
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        page.on(
            "console",
            lambda msg: (
                self.errors.append(msg.text) if "Content Security Policy" in msg.text else None
            ),
        )

    def _on_answered(self, request: Request) -> None:
        self.pending.pop(request, None)

    def _on_request(self, request: Request) -> None:
        self.pending[request] = urlsplit(request.url).path
        if "/v1/" in request.url:
            self.requests.append(request)

    def _on_response(self, response: Response) -> None:
        if "/v1/" in response.url:
            self.responses.append((response.url, response.status))
            kind = response.headers.get("content-type", "")
            if response.status == 200 and kind.startswith("text/event-stream"):
                self.event_streams.append(response.url)

    def open(self, path: str) -> None:
        """Load the page and wait for its load event. A failed load names the requests still
        unanswered (a stalled module, a server that stopped answering) rather than a bare
        timeout."""
        try:
            self.page.goto(self.base_url + path)
        except PlaywrightTimeoutError as exc:
            waiting = sorted(self.pending.values())
            raise AssertionError(f"the page did not load; still unanswered: {waiting}") from exc

    def history_queries(self, job_id: int) -> list[dict[str, str]]:
        """Query parameters of each history request for one job, in order."""
        out = []
        for request in list(self.requests):
            parts = urlsplit(request.url)
            if parts.path == f"/v1/jobs/{job_id}/history":
                out.append({k: v[0] for k, v in parse_qs(parts.query).items()})
        return out

    def requests_to(self, path: str) -> list[Request]:
        """The requests for one path (any query), in order."""
        return [r for r in list(self.requests) if urlsplit(r.url).path == path]

    def pending_to(self, path: str) -> list[Request]:
        """The requests for one path (any query) not yet answered."""
        return [r for r, p in list(self.pending.items()) if p == path]

    def job_polls(self, job_id: int) -> list[Request]:
        return self.requests_to(f"/v1/jobs/{job_id}")

    def streams(self, job_id: int) -> list[Request]:
        return self.requests_to(f"/v1/jobs/{job_id}/events")

    def job_row(self, job_id: int) -> Any:
        return self.page.locator(f'#jobs tbody tr[data-job-id="{job_id}"]')

    def local_token(self) -> Any:
        return self.page.evaluate("localStorage.getItem('halfway.token')")


def new_context(browser: Browser, *, width: int = 1280, height: int = 1000) -> BrowserContext:
    """A fresh browser profile. Each wait on the page may take 10 s; a load, 30 s: it is some
    twenty requests to a server that shares its process (and two cores) with the test's
    workers, and under a full suite's load one took over 10 s (no request failed)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    context.set_default_timeout(10_000)
    context.set_default_navigation_timeout(30_000)
    return context


@pytest.fixture
def dash(browser: Browser, base_url: str) -> Iterator[Dashboard]:
    context = new_context(browser)
    dashboard = Dashboard(context.new_page(), base_url)
    yield dashboard
    context.close()
    assert dashboard.errors == [], "script errors or CSP violations on the page"


# --------------------------------------------------------------------------------------------
# Jobs and history straight into the database (no worker runs here)


def add_job(
    db: Database,
    settings: Settings,
    *,
    name: str = "job",
    owner: str = "alice",
    status: str = "running",
    total_steps: int | None = 1000,
    **fields: Any,
) -> int:
    with db.write() as session:
        job = jobs.create_job(
            session,
            owner=owner,
            submitted=normalization.normalize(JobSpec(name=name), settings),
            now=utcnow(),
        )
        job.status = status
        job.total_steps = total_steps
        if status != "queued":
            job.attempt = 1
            job.started_at = utcnow()
        for key, value in fields.items():
            setattr(job, key, value)
        session.flush()
        return job.id


def records(
    start: int,
    count: int,
    *,
    overflow_at: Sequence[int] = (),
    nan_at: Sequence[int] = (),
    scale: float = 32768.0,
) -> list[StepRecord]:
    """A decaying loss; the scale halves after each overflow step, as dynamic scaling does."""
    overflows, nans = set(overflow_at), set(nan_at)
    out = []
    for step in range(start, start + count):
        loss = math.nan if step in nans else 2.5 * 0.999**step + 0.05 * ((step * 7) % 11) / 11
        finite = step not in overflows
        out.append(StepRecord(step, step // 500, loss, scale, finite))
        if not finite:
            scale = max(1.0, scale / 2)
    return out


def write(db: Database, job_id: int, rows: list[StepRecord], batch: int = 20_000) -> None:
    for i in range(0, len(rows), batch):
        with db.write() as session:
            job = session.get(Job, job_id)
            assert job is not None
            history.write_steps(session, job, rows[i : i + batch], now=utcnow())


def finish(db: Database, job_id: int, status: str = "succeeded") -> None:
    with db.write() as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.status = status
        job.finished_at = utcnow()


def set_hidden(page: Page, hidden: bool) -> None:
    """Make the page believe its tab was hidden (or shown again), as switching tabs does."""
    page.evaluate(
        """(hidden) => {
            Object.defineProperty(document, "hidden", { value: hidden, configurable: true });
            document.dispatchEvent(new Event("visibilitychange"));
        }""",
        hidden,
    )


def wait_until(page: Page, check: Any, timeout: float = 10.0) -> None:
    """Poll a condition on what the page recorded. Waits through Playwright, never with
    time.sleep: the sync API only delivers the page's events while it is being called."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        page.wait_for_timeout(50)


# --------------------------------------------------------------------------------------------
# Serving


def test_page_has_a_strict_content_security_policy_and_is_revalidated(
    client: TestClient,
) -> None:
    page = client.get("/")
    assert page.status_code == 200
    directives = dict(
        d.strip().split(" ", 1) for d in page.headers["content-security-policy"].split(";")
    )
    assert directives["script-src"] == "'self'"  # no inline script, no inline handlers
    assert directives["frame-ancestors"] == "'none'"
    assert page.headers["cache-control"] == "no-cache"
    assert page.headers["referrer-policy"] == "no-referrer"
    for path in ("/static/app.js", "/static/style.css", "/static/vendor/uplot/uPlot.iife.min.js"):
        asset = client.get(path)
        assert asset.status_code == 200, path
        assert asset.headers["cache-control"] == "no-cache"
    assert "uPlot 1.6.32" in client.get("/static/vendor/uplot/VERSION").text


def test_the_dashboard_script_is_es_modules_served_as_javascript(client: TestClient) -> None:
    page = client.get("/").text
    assert '<script type="module" src="/static/app.js"></script>' in page
    modules = {path.name: path.read_text() for path in STATIC.glob("*.js")}
    reached: set[str] = set()
    todo = ["app.js"]
    while todo:
        name = todo.pop()
        reached.add(name)
        for imported in re.findall(r'^import \{[^}]*\} from "\./([\w.]+)";', modules[name], re.M):
            assert imported in modules, (name, imported)
            if imported not in reached:
                todo.append(imported)
    assert reached == set(modules)  # app.js reaches every module; none is left unloaded
    for name, text in modules.items():
        assert text.count("\n") <= 600, name  # a file one can read
        asset = client.get(f"/static/{name}")
        assert asset.status_code == 200, name
        # A module runs only with a JavaScript type (the page sends nosniff).
        assert asset.headers["content-type"].startswith("text/javascript"), name
        assert asset.headers["x-content-type-options"] == "nosniff"


# --------------------------------------------------------------------------------------------
# Token


def test_token_link_is_stored_and_removed_from_the_address_bar(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="first")
    dash.open(f"/?token={team.alice}&{FAST}")
    expect(dash.job_row(job_id)).to_be_visible()

    assert dash.page.url == f"{dash.base_url}/?{FAST}"
    assert dash.local_token() == team.alice
    assert dash.requests
    assert all(r.headers.get("authorization") == f"Bearer {team.alice}" for r in dash.requests)

    # A plain visit later finds the token in local storage.
    dash.open("/")
    expect(dash.job_row(job_id)).to_be_visible()
    expect(dash.page.locator("#auth")).to_be_hidden()
    assert team.alice not in dash.page.url


def test_a_refused_token_asks_for_another_and_the_new_one_is_used(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="after-login")
    dash.open(f"/?token=hw_not_a_real_token&{FAST}")
    expect(dash.page.locator("#auth")).to_be_visible()
    expect(dash.page.locator("#auth-message")).to_contain_text("refused")
    expect(dash.page.locator("#app")).to_be_hidden()
    assert any(urlsplit(u).path == "/v1/jobs" and s == 401 for u, s in dash.responses)

    dash.page.fill("#auth-token", team.bob)
    dash.page.click("#auth-form button[type=submit]")
    expect(dash.job_row(job_id)).to_be_visible()
    expect(dash.page.locator("#auth")).to_be_hidden()
    assert dash.local_token() == team.bob


def test_without_a_token_the_page_asks_for_one(dash: Dashboard, team: Team) -> None:
    dash.open(f"/?{FAST}")
    expect(dash.page.locator("#auth")).to_be_visible()
    expect(dash.page.locator("#auth-message")).to_contain_text("needs an API token")
    assert dash.local_token() is None


def test_with_auth_off_no_token_is_needed(
    browser: Browser, settings: Settings, db: Database
) -> None:
    job_id = add_job(db, settings, name="local")
    with serve(create_app(settings, db, auth=False)) as url:
        context = new_context(browser)
        try:
            dashboard = Dashboard(context.new_page(), url)
            dashboard.open(f"/?{FAST}")
            expect(dashboard.job_row(job_id)).to_be_visible()
            expect(dashboard.page.locator("#auth")).to_be_hidden()
            assert dashboard.errors == []
        finally:
            context.close()


# --------------------------------------------------------------------------------------------
# Job list and one job's charts


def test_job_list_shows_status_progress_scale_and_overflow_count(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    running = add_job(db, settings, name="mnist-fp16", owner="alice", total_steps=1000)
    write(db, running, records(0, 300, overflow_at=[10, 20, 250]))
    queued = add_job(db, settings, name="waiting", owner="bob", status="queued")
    dash.open(f"/?token={team.alice}&{FAST}")

    row = dash.job_row(running)
    expect(row.locator(".job-name")).to_have_text("mnist-fp16")
    expect(row.locator(".id")).to_have_text(str(running))
    expect(row.locator(".owner")).to_have_text("alice")
    expect(row.locator(".status")).to_have_text("running")
    expect(row.locator(".progress-text")).to_have_text("300 / 1,000")
    expect(row.locator(".scale")).to_have_text("4096 (2¹²)")  # 2^15 halved three times
    expect(row.locator(".overflows")).to_have_text("3")
    expect(dash.job_row(queued).locator(".status")).to_have_text("queued")
    expect(dash.job_row(queued).locator(".overflows")).to_have_text("0")
    # Newest first, as the API lists them.
    ids = dash.page.locator("#jobs tbody tr").evaluate_all("rows => rows.map(r => r.dataset.jobId)")
    assert ids == [str(queued), str(running)]


def test_charts_render_and_mark_every_overflow_step(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    overflow_steps = [50, 51, 120, 300, 399]
    job_id = add_job(
        db,
        settings,
        name="overflowing",
        status="failed",
        error="guard: too many overflows",
        metrics={
            "last_epoch": {"epoch": 1, "accuracy": 0.875},
            "timing": {"examples_per_second": 21000.25, "peak_memory_bytes": 3 * 2**20},
        },
        steps_per_second=123.4,
    )
    # Step 51 overflows with a NaN loss: it still gets a marker on the loss chart.
    write(db, job_id, records(0, 400, overflow_at=overflow_steps, nan_at=[51]))
    dash.open(f"/?token={team.alice}&{FAST}")
    dash.job_row(job_id).click()

    loss_chart = dash.page.locator("#loss-chart")
    expect(loss_chart).to_have_attribute("data-points", "400")
    expect(loss_chart.locator("canvas")).to_have_count(1)
    expect(dash.page.locator("#scale-chart canvas")).to_have_count(1)
    expect(loss_chart).to_have_attribute("data-mode", "raw")
    expect(loss_chart).to_have_attribute("data-overflow-markers", str(len(overflow_steps)))
    expect(dash.page.locator("#scale-chart")).to_have_attribute(
        "data-overflow-markers", str(len(overflow_steps))
    )
    expect(loss_chart.locator(".u-legend .marker")).to_have_count(1)  # "overflow" in the legend
    assert "job=" in dash.page.url  # the selection survives a reload
    summary = dash.page.locator("#job-summary")
    expect(summary).to_contain_text("Steps/s")
    expect(summary).to_contain_text("123.4")
    expect(dash.page.locator("#job-problems pre.error")).to_have_text("guard: too many overflows")
    # Metrics are labelled numbers, not JSON objects: each group a heading, then its members
    # (tests/test_dashboard_panels.py pins the labels and units further).
    metrics = dash.page.locator("#job-metrics")
    expect(metrics.locator("dt")).to_have_text(
        ["Last epoch", "Epoch", "Accuracy", "Timing", "Examples/s", "Peak memory"]
    )
    expect(metrics.locator("dd")).to_have_text(["2", "0.875", "21,000\u00a0/s", "3.0\u00a0MiB"])
    expect(dash.page.locator("#job-status")).to_have_text("failed")


def test_polling_live_updates_fetch_only_new_rows(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    """The polling path (?stream=0; also what the page falls back to without its stream)."""
    job_id = add_job(db, settings, name="live", total_steps=1000)
    write(db, job_id, records(0, 100, overflow_at=[40]))
    dash.open(f"/?token={team.alice}&{FAST}&{POLLING}#job={job_id}")
    loss_chart = dash.page.locator("#loss-chart")
    expect(loss_chart).to_have_attribute("data-points", "100")
    expect(loss_chart).to_have_attribute("data-overflow-markers", "1")

    # While nothing is written the page re-reads the job (a 304 by ETag) and skips the
    # history request altogether.
    dash.page.wait_for_timeout(800)
    assert [q["after_step"] for q in dash.history_queries(job_id)] == ["-1"]
    job_url = f"{dash.base_url}/v1/jobs/{job_id}"
    assert (job_url, 304) in dash.responses

    tail = records(100, 60, overflow_at=[130], scale=16384.0)
    write(db, job_id, tail)
    expect(loss_chart).to_have_attribute("data-points", "160")
    expect(loss_chart).to_have_attribute("data-overflow-markers", "2")
    expect(dash.job_row(job_id).locator(".progress-text")).to_have_text("160 / 1,000")
    expect(dash.job_row(job_id).locator(".overflows")).to_have_text("2")

    cursors = [int(q["after_step"]) for q in dash.history_queries(job_id)]
    assert cursors[0] == -1 and 99 in cursors
    assert cursors == sorted(cursors), "the cursor never goes back"
    assert cursors.count(-1) == 1, "the history is never read again from the start"
    assert all("points" not in q for q in dash.history_queries(job_id))
    # Rows come as columns, the shape uPlot takes, not as an object per row.
    assert all(q.get("format") == "columns" for q in dash.history_queries(job_id))
    assert dash.streams(job_id) == []
    expect(dash.page.locator("#live")).to_have_attribute("data-transport", "poll")


# --------------------------------------------------------------------------------------------
# Live updates through the job's event stream


def stream_answered(dash: Dashboard, job_id: int) -> int:
    """How many of the job's stream requests were answered with an event stream."""
    path = f"/v1/jobs/{job_id}/events"
    return sum(1 for url in list(dash.event_streams) if urlsplit(url).path == path)


def test_a_streamed_job_gets_its_new_rows_without_polling_the_job_or_its_history(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    """The page reads the job and its rows once, then listens: rows and each change of the
    job arrive as events, while the job list is still polled."""
    job_id = add_job(db, settings, name="streamed", total_steps=1000)
    write(db, job_id, records(0, 100, overflow_at=[40]))
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    loss_chart = dash.page.locator("#loss-chart")
    expect(loss_chart).to_have_attribute("data-points", "100")
    wait_until(dash.page, lambda: stream_answered(dash, job_id) == 1)
    expect(dash.page.locator("#live")).to_have_attribute("data-transport", "stream")
    lists = len(dash.requests_to("/v1/jobs"))

    for start in (100, 160, 220):  # rows keep arriving, as from a training job
        write(db, job_id, records(start, 60, overflow_at=[start + 30], scale=16384.0))
        expect(loss_chart).to_have_attribute("data-points", str(start + 60))
    expect(loss_chart).to_have_attribute("data-overflow-markers", "4")
    expect(loss_chart).to_have_attribute("data-distinct-steps", "280")
    # The status events carry the whole job: its summary follows without a poll.
    expect(dash.page.locator("#job-summary")).to_contain_text("280 / 1,000 steps")

    finish(db, job_id)
    expect(dash.page.locator("#job-status")).to_have_text("succeeded")
    dash.page.wait_for_timeout(600)  # three ticks: none of them asks for the job

    assert len(dash.job_polls(job_id)) == 1, "the job is read once, for the first render"
    assert [q["after_step"] for q in dash.history_queries(job_id)] == ["-1"]
    streams = dash.streams(job_id)
    assert len(streams) == 1, "one stream, never reopened (not even after its end)"
    assert parse_qs(urlsplit(streams[0].url).query)["after_step"] == ["99"]
    # From the rows held, with their version: a rewrite since then would come as a reset.
    assert streams[0].headers.get("last-event-id") == "0:99"
    assert streams[0].headers.get("authorization") == f"Bearer {team.alice}"
    assert len(dash.requests_to("/v1/jobs")) > lists + 2, "the job list is still polled"


@pytest.mark.parametrize("failure", ["refused", "bad gateway", "not a stream"])
def test_without_its_stream_the_page_polls_and_tries_the_stream_again_later(
    dash: Dashboard, db: Database, settings: Settings, team: Team, failure: str
) -> None:
    """What a proxy in front of the server may do to a stream: refuse the connection, answer
    502, or answer 200 with a page of its own. The page reconnects a few times, then polls
    the job as it did before it listened (new rows still show), and later tries again."""

    def block(route: Route) -> None:
        if failure == "refused":
            route.abort("connectionrefused")
        elif failure == "bad gateway":
            route.fulfill(status=502, content_type="text/html", body="<h1>502 Bad Gateway</h1>")
        else:
            route.fulfill(status=200, content_type="text/html", body="<p>Sign in to the proxy</p>")

    events = "**/v1/jobs/*/events*"
    dash.page.route(events, block)
    job_id = add_job(db, settings, name="behind-a-proxy", total_steps=1000)
    write(db, job_id, records(0, 100))
    dash.open(f"/?token={team.alice}&{FAST}&stream_retry_ms=2000#job={job_id}")
    loss_chart = dash.page.locator("#loss-chart")
    expect(loss_chart).to_have_attribute("data-points", "100")

    write(db, job_id, records(100, 60, overflow_at=[130]))
    # The page backs off 1 s, then 2 s, before it polls: Playwright's default 5 s leaves too
    # little for the three tries and a poll on a loaded machine.
    expect(loss_chart).to_have_attribute("data-points", "160", timeout=20_000)
    assert len(dash.streams(job_id)) >= 3, "three tries before polling"
    assert "99" in [q["after_step"] for q in dash.history_queries(job_id)], "polled for rows"
    assert len(dash.job_polls(job_id)) > 1
    expect(dash.page.locator("#live")).to_have_attribute("data-transport", "poll")
    expect(dash.page.locator("#live")).to_have_attribute(
        "title", re.compile("^polling \\(the event stream failed")
    )

    # The proxy lets streams through again: the next try listens, and polling stops.
    dash.page.unroute(events)
    wait_until(dash.page, lambda: stream_answered(dash, job_id) == 1)
    expect(dash.page.locator("#live")).to_have_attribute("data-transport", "stream")
    polls, histories = len(dash.job_polls(job_id)), len(dash.history_queries(job_id))
    assert dash.streams(job_id)[-1].headers.get("last-event-id") == "0:159"
    write(db, job_id, records(160, 60, overflow_at=[200]))
    expect(loss_chart).to_have_attribute("data-points", "220")
    expect(loss_chart).to_have_attribute("data-distinct-steps", "220")
    expect(loss_chart).to_have_attribute("data-overflow-markers", "2")
    assert (len(dash.job_polls(job_id)), len(dash.history_queries(job_id))) == (polls, histories)


def test_a_stream_refused_for_its_token_asks_for_another(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    """A 401 on the stream brings up the token form, as one on a poll does; the new token
    is the one the stream then goes on with."""
    events = "**/v1/jobs/*/events*"
    dash.page.route(
        events,
        lambda route: route.fulfill(
            status=401,
            content_type="application/json",
            body='{"error": "unauthorized", "message": "token revoked", "fields": []}',
        ),
    )
    job_id = add_job(db, settings, name="revoked")
    write(db, job_id, records(0, 50))
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    expect(dash.page.locator("#auth")).to_be_visible()
    expect(dash.page.locator("#auth-message")).to_contain_text("refused the token (token revoked)")
    assert len(dash.streams(job_id)) == 1, "a refused token is not retried"

    dash.page.unroute(events)
    dash.page.fill("#auth-token", team.bob)
    dash.page.click("#auth-form button[type=submit]")
    wait_until(dash.page, lambda: stream_answered(dash, job_id) == 1)
    assert dash.streams(job_id)[-1].headers.get("authorization") == f"Bearer {team.bob}"
    expect(dash.page.locator("#loss-chart")).to_have_attribute("data-points", "50")


def test_a_hidden_tab_closes_the_stream_and_goes_on_from_the_last_event_when_shown(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(db, settings, name="hidden", total_steps=1000)
    write(db, job_id, records(0, 100))
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")
    loss_chart = dash.page.locator("#loss-chart")
    expect(loss_chart).to_have_attribute("data-points", "100")
    wait_until(dash.page, lambda: stream_answered(dash, job_id) == 1)

    # The tab is hidden while a refresh is under way: the refresh's job-list poll is held
    # until then. It goes on after the switch and must not reopen the stream, as it did when
    # a full run's timing let a refresh straddle the switch.
    held: list[Route] = []

    def list_polls(url: str) -> bool:
        return urlsplit(url).path == "/v1/jobs"

    def hold_the_first(route: Route) -> None:
        if held:
            route.continue_()
        else:
            held.append(route)

    dash.page.route(list_polls, hold_the_first)
    wait_until(dash.page, lambda: held)
    aborted: list[str] = []
    dash.page.on("requestfailed", lambda r: aborted.append(r.url) if "/events" in r.url else None)
    set_hidden(dash.page, True)
    wait_until(dash.page, lambda: aborted)
    write(db, job_id, records(100, 60))
    held[0].continue_()
    wait_until(dash.page, lambda: not dash.pending_to("/v1/jobs"))
    dash.page.wait_for_timeout(2000)  # the server sends rows within a second to a listener
    expect(loss_chart).to_have_attribute("data-points", "100")
    expect(dash.page.locator("#live")).to_have_attribute("data-state", "paused")
    assert len(dash.streams(job_id)) == 1

    set_hidden(dash.page, False)
    expect(loss_chart).to_have_attribute("data-points", "160")
    expect(loss_chart).to_have_attribute("data-distinct-steps", "160")
    streams = dash.streams(job_id)
    assert len(streams) == 2
    assert streams[1].headers.get("last-event-id") == "0:99"  # where the last event left off
    assert len(dash.job_polls(job_id)) == 1
    assert [q["after_step"] for q in dash.history_queries(job_id)] == ["-1"]


# --------------------------------------------------------------------------------------------
# Long runs: buckets, zoom, and the switch from raw rows


def drag(page: Page, selector: str, start: float, end: float) -> None:
    """Drag across a uPlot chart from one fraction of its width to another."""
    box = page.locator(f"{selector} .u-over").bounding_box()
    assert box is not None
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * start, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * (start + end) / 2, y, steps=3)
    page.mouse.move(box["x"] + box["width"] * end, y, steps=3)
    page.mouse.up()


def test_a_long_run_is_drawn_from_buckets_and_zoom_requeries_the_range(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    n = 25_000  # above the page's default threshold of 20,000 steps
    overflow_steps = list(range(137, n, 997))
    job_id = add_job(db, settings, name="long", status="succeeded", total_steps=n)
    write(db, job_id, records(0, n, overflow_at=overflow_steps))
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")

    loss_chart = dash.page.locator("#loss-chart")
    expect(loss_chart).to_have_attribute("data-mode", "buckets")
    expect(loss_chart).to_have_attribute("data-overflow-steps", str(len(overflow_steps)))
    queries = dash.history_queries(job_id)
    assert queries and all("points" in q and "after_step" not in q for q in queries)
    points = int(queries[0]["points"])
    assert 200 <= points <= 1300  # about the chart's width in pixels, not the step count

    # Every bucket that holds an overflow has its marker.
    page = httpx.get(
        f"{dash.base_url}/v1/jobs/{job_id}/history?points={points}",
        headers=Team.header(team.alice),
    ).json()
    with_overflow = sum(1 for b in page["buckets"] if b["overflow_count"] > 0)
    expect(loss_chart).to_have_attribute("data-overflow-markers", str(with_overflow))
    expect(dash.page.locator("#scale-chart")).to_have_attribute(
        "data-overflow-markers", str(with_overflow)
    )
    width = int(loss_chart.get_attribute("data-bucket-width") or 0)
    assert width > 1

    # Zoom to ~2% of the run: the page asks for that range, and the buckets narrow to steps.
    drag(dash.page, "#loss-chart", 0.40, 0.42)
    wait_until(dash.page, lambda: any("from_step" in q for q in dash.history_queries(job_id)))
    zoomed = [q for q in dash.history_queries(job_id) if "from_step" in q][-1]
    lo, hi = int(zoomed["from_step"]), int(zoomed["to_step"])
    assert 8_000 < lo < hi < 12_000 and hi - lo < 1_000
    expect(loss_chart).to_have_attribute("data-bucket-width", "1")
    expect(dash.page.locator("#reset-zoom")).to_be_visible()

    # A double-click shows the whole run again (re-queried, as the zoomed buckets are all the
    # page holds).
    asked = len(dash.history_queries(job_id))
    dash.page.locator("#scale-chart .u-over").dblclick()
    wait_until(dash.page, lambda: len(dash.history_queries(job_id)) > asked)
    assert "from_step" not in dash.history_queries(job_id)[-1]
    expect(loss_chart).to_have_attribute("data-bucket-width", str(width))
    expect(dash.page.locator("#reset-zoom")).to_be_hidden()


@pytest.mark.parametrize("transport", ["stream", "poll"])
def test_a_run_that_grows_past_the_threshold_switches_to_buckets(
    dash: Dashboard, db: Database, settings: Settings, team: Team, transport: str
) -> None:
    job_id = add_job(db, settings, name="growing", total_steps=5000)
    write(db, job_id, records(0, 800, overflow_at=[100]))
    polling = f"&{POLLING}" if transport == "poll" else ""
    dash.open(f"/?token={team.alice}&{FAST}{polling}&bucket_threshold=1000#job={job_id}")
    loss_chart = dash.page.locator("#loss-chart")
    expect(loss_chart).to_have_attribute("data-mode", "raw")
    expect(loss_chart).to_have_attribute("data-points", "800")

    write(db, job_id, records(800, 2200, overflow_at=[900, 2500], scale=16384.0))
    expect(loss_chart).to_have_attribute("data-mode", "buckets")
    expect(loss_chart).to_have_attribute("data-overflow-steps", "3")
    queries = dash.history_queries(job_id)
    switched = next(i for i, q in enumerate(queries) if "points" in q)
    assert all("after_step" in q for q in queries[:switched])
    assert all("points" in q for q in queries[switched:])

    # Still live in bucket mode.
    write(db, job_id, records(3000, 2000, overflow_at=[4000], scale=4096.0))
    expect(loss_chart).to_have_attribute("data-overflow-steps", "4")
    if transport == "stream":
        # The stream's status events told it when the buckets were outdated; only the
        # buckets were read, never the job or raw rows after the first load.
        assert len(dash.job_polls(job_id)) == 1
        assert [q["after_step"] for q in queries[:switched]] == ["-1"]
        assert len(dash.streams(job_id)) == 1


# --------------------------------------------------------------------------------------------
# Comparison


def test_checked_jobs_are_overlaid_on_one_bucket_grid(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    first = add_job(db, settings, name="fp16-run", status="succeeded")
    write(db, first, records(0, 600, overflow_at=[100, 200]))
    second = add_job(db, settings, name="bf16-run", status="succeeded")
    write(db, second, records(0, 900))
    dash.open(f"/?token={team.alice}&{FAST}")
    expect(dash.page.locator("#compare")).to_be_hidden()

    dash.job_row(first).locator(".compare-box").check()
    dash.job_row(second).locator(".compare-box").check()
    compare = dash.page.locator("#compare")
    expect(compare).to_be_visible()
    expect(compare.locator("#compare-loss-chart")).to_have_attribute(
        "data-jobs", f"{first},{second}"
    )
    expect(compare.locator("#compare-loss-chart canvas")).to_have_count(1)
    expect(compare.locator("#compare-scale-chart canvas")).to_have_count(1)
    expect(compare.locator("#compare-loss-chart .u-legend")).to_contain_text("fp16-run")
    expect(compare.locator("#compare-loss-chart .u-legend")).to_contain_text("bf16-run")
    asked = [r.url for r in dash.requests if urlsplit(r.url).path == "/v1/history"]
    assert asked and parse_qs(urlsplit(asked[-1]).query)["job_ids"] == [f"{first},{second}"]
    assert "points" in parse_qs(urlsplit(asked[-1]).query)
    grid = httpx.get(asked[-1], headers=Team.header(team.alice)).json()
    marked = sum(1 for j in grid["jobs"] for b in j["buckets"] if b["overflow_count"] > 0)
    assert marked >= 1
    expect(dash.page.locator("#compare-note")).to_contain_text(f" {marked} buckets with overflows")


# --------------------------------------------------------------------------------------------
# Injection


def test_html_in_job_fields_is_shown_as_text_and_never_runs(
    dash: Dashboard, db: Database, settings: Settings, team: Team
) -> None:
    job_id = add_job(
        db,
        settings,
        name=PAYLOAD,
        owner=SHORT_PAYLOAD,
        status="failed",
        error=PAYLOAD,
        warnings=[PAYLOAD],
        guard_warning=PAYLOAD,
        metrics={PAYLOAD: PAYLOAD},
    )
    write(db, job_id, records(0, 50, overflow_at=[10]))
    dash.open(f"/?token={team.alice}&{FAST}#job={job_id}")

    row = dash.job_row(job_id)
    expect(row.locator(".job-name")).to_have_text(PAYLOAD)
    expect(row.locator(".owner")).to_have_text(SHORT_PAYLOAD)
    expect(dash.page.locator("#job-title")).to_contain_text(PAYLOAD)
    expect(dash.page.locator("#job-title")).to_contain_text(SHORT_PAYLOAD)
    expect(dash.page.locator("#job-problems pre.error")).to_have_text(PAYLOAD)
    expect(dash.page.locator("#job-problems .warning")).to_have_text(PAYLOAD)
    expect(dash.page.locator("#job-problems ul.warnings li")).to_have_text(PAYLOAD)
    expect(dash.page.locator("#job-metrics dt")).to_have_text(PAYLOAD)
    expect(dash.page.locator("#loss-chart")).to_have_attribute("data-points", "50")

    dash.page.wait_for_timeout(500)  # time for an injected onerror to fire, were there one
    assert dash.page.evaluate("window.__pwned") is None
    # Shown as text, so no element came from the payload (the CSP would only be a second line).
    assert dash.page.locator("img").count() == 0
    assert dash.page.locator("body script").count() == 2  # uPlot and app.js (the modules)


# --------------------------------------------------------------------------------------------
# A resumed job


@pytest.mark.parametrize("transport", ["stream", "poll"])
def test_a_job_resumed_after_a_crash_shows_every_step_once_and_only_the_new_attempt(
    dash: Dashboard, db: Database, settings: Settings, team: Team, tmp_path: Path, transport: str
) -> None:
    """A real supervisor runs a fake trainer (a spawned process, no TensorFlow) that trains
    steps 0..199 with overflows at 150, 160 and 170, checkpoints at 128 and is killed; the
    job resumes from 128 and trains to 299 with overflows at 140 and 250 only. The page,
    which drew attempt 1's rows, must end with each step once and only the new attempt's
    overflows: its rows from 128 on were replaced. Listening, the page learns it from the
    stream's `reset`; polling, from the job's history_version."""
    crash = settings.resolved_data_dir() / "crash-now"
    plan = [
        {
            "until": 200,
            "total": 300,
            "checkpoint_at": 128,
            "overflow_at": [150, 160, 170],
            "wait_for": crash.name,
            "then": "crash",
        },
        {"until": 300, "overflow_at": [140, 250]},
    ]
    job_id = make_job(db, {"mode": "plan", "plan": plan}, name="resumed")
    supervisor = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    worker = threading.Thread(target=supervisor.run_forever, daemon=True)
    worker.start()
    try:
        polling = f"&{POLLING}" if transport == "poll" else ""
        dash.open(f"/?token={team.alice}&{FAST}{polling}#job={job_id}")
        loss_chart = dash.page.locator("#loss-chart")
        expect(loss_chart).to_have_attribute("data-points", "200")
        expect(loss_chart).to_have_attribute("data-overflow-markers", "3")
        crash.touch()
        expect(dash.job_row(job_id).locator(".status")).to_have_text("succeeded", timeout=60_000)
        expect(loss_chart).to_have_attribute("data-points", "300")
        expect(loss_chart).to_have_attribute("data-overflow-markers", "2")
        expect(dash.page.locator("#scale-chart")).to_have_attribute("data-overflow-markers", "2")
        expect(loss_chart).to_have_attribute("data-distinct-steps", "300")
        expect(loss_chart).to_have_attribute("data-history-version", "1")
    finally:
        supervisor.stop()
        worker.join(30)
    with db.read() as session:
        job = session.get(Job, job_id)
        assert job is not None
        assert (job.attempt, job.history_version, job.history_reset_step) == (2, 1, 128)
        assert job.overflow_count == 2
    if transport == "stream":
        # The job and its first rows were read once; all else came through one stream.
        assert len(dash.job_polls(job_id)) == 1
        assert [q["after_step"] for q in dash.history_queries(job_id)] == ["-1"]
        assert len(dash.streams(job_id)) == 1
        return
    # It went back to the cut, not to the start, and read on from there.
    cursors = [int(q["after_step"]) for q in dash.history_queries(job_id)]
    back = cursors.index(127)
    # Before the cut it read attempt 1's rows, in one page or several under load (the fake
    # sends batches of 10, so a cursor ends one: 9, 19, ... 199), never past them.
    assert all(c == -1 or (c % 10 == 9 and c <= 199) for c in cursors[:back]), cursors
    assert min(cursors[back:]) == 127, cursors
