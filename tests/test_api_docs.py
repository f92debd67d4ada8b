"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) work on a server cut off from the internet:
every script, style and icon they load is shipped in the package (``service/api/docs_pages.py``).

The browser test opens both pages in headless Chromium with every request that would leave
loopback aborted and recorded, and finds each UI drawn from the API's own document. The
others check, without a browser, that the pages name only local URLs, that each answers with
the right type and no token, and that the vendored files are the ones their VERSION notes
name."""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient
from playwright.sync_api import Browser, BrowserContext, Route, expect
from playwright.sync_api import Request as BrowserRequest

from service.api.app import create_app
from service.api.routes.dashboard import STATIC
from service.database.db import Database
from service.settings import Settings
from tests.test_dashboard import serve

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PAGES = ("/docs", "/redoc")
# What each asset must be served as (Python 3.11 names .js application/javascript, 3.12 on
# text/javascript; browsers take both).
CONTENT_TYPES = {
    ".js": ("application/javascript", "text/javascript"),
    ".css": ("text/css",),
    ".png": ("image/png",),
}
# The URLs a page names: attributes, Swagger UI's `url: '...'` and ReDoc's spec-url.
URL_IN_PAGE = re.compile(r"""(?:src|href|spec-url)="([^"]*)"|\burl: '([^']*)'""")
VENDOR = STATIC / "vendor"


@pytest.fixture
def db_url(tmp_path: Path, sqlite_template: Path) -> str:
    """SQLite only: the pages never touch the database, so one backend is enough."""
    path = tmp_path / "halfway.db"
    shutil.copy(sqlite_template, path)
    return f"sqlite:///{path}"


def page_urls(html: str) -> list[str]:
    return [a or b for a, b in URL_IN_PAGE.findall(html)]


# --------------------------------------------------------------------------------------------
# Without a browser


@pytest.mark.parametrize("page", PAGES)
def test_page_names_only_local_assets_that_answer(client: TestClient, page: str) -> None:
    """No token needed (as before), every URL the page names is on this server, and each
    answers 200 with the type a browser will run or apply."""
    r = client.get(page)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/html")
    assert "fonts.googleapis.com" not in r.text
    urls = page_urls(r.text)
    assert "/openapi.json" in urls, urls
    assets = [url for url in urls if url != "/openapi.json"]
    assert any(url.endswith(".js") for url in assets), assets
    for url in urls:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc and url.startswith("/"), url
    for url in assets:
        answer = client.get(url)
        assert answer.status_code == 200, url
        suffix = Path(url).suffix
        kind = answer.headers["content-type"].split(";")[0]
        assert kind in CONTENT_TYPES[suffix], (url, kind)
        assert len(answer.content) == (STATIC / url.removeprefix("/static/")).stat().st_size
    # ReDoc's attribution logo would come from a CDN; the policy keeps images local.
    assert r.headers["content-security-policy"] == "img-src 'self' data:"


def test_pages_follow_the_root_path(settings: Settings, db: Database) -> None:
    """Behind a proxy that mounts the API under a prefix, the page's URLs carry it."""
    with TestClient(create_app(settings, db), root_path="/halfway") as client:
        for page in PAGES:
            urls = page_urls(client.get(page).text)
            assert urls and all(url.startswith("/halfway/") for url in urls), urls


def test_oauth2_redirect_page_is_kept(client: TestClient) -> None:
    """FastAPI's default pages came with Swagger UI's OAuth2 redirect page; it stays."""
    r = client.get("/docs/oauth2-redirect")
    assert r.status_code == 200
    assert "oauth2" in r.text


@pytest.mark.parametrize("package", ["swagger-ui", "redoc"])
def test_vendored_files_match_their_note(package: str) -> None:
    """Each VERSION note lists the files copied from npm with their sha256: a half-done
    upgrade (a file copied, the note not updated, or the other way round) fails here."""
    note = (VENDOR / package / "VERSION").read_text()
    listed = re.findall(r"^\s+(\S+)\s+sha256 ([0-9a-f]{64})$", note, re.MULTILINE)
    assert listed, note
    for name, digest in listed:
        assert hashlib.sha256((VENDOR / package / name).read_bytes()).hexdigest() == digest
    # The licenses travel with the files: the package's own, and the third-party ones that
    # each bundle's header points to.
    assert (VENDOR / package / "LICENSE").stat().st_size > 0
    for name, _ in listed:
        if name.endswith(".js"):
            assert (VENDOR / package / f"{name}.LICENSE.txt").stat().st_size > 0


# --------------------------------------------------------------------------------------------
# In a browser with no way out


class Offline:
    """A browser context whose every request to a host other than loopback is aborted and
    recorded, as on a GPU server with no internet."""

    def __init__(self, context: BrowserContext) -> None:
        self.context = context
        self.blocked: list[str] = []  # aborted by the route
        self.outside: list[BrowserRequest] = []  # every request for elsewhere the pages made
        self.errors: list[str] = []
        context.route("**/*", self._route)
        context.on("request", self._on_request)

    @staticmethod
    def _outside(url: str) -> bool:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https", "ws", "wss") and parts.hostname not in LOOPBACK

    def left(self) -> list[str]:
        """Requests for elsewhere that went out by any path (workers too), the route's or
        not: all but those the page's Content-Security-Policy refused in the browser."""
        return [r.url for r in self.outside if r.failure != "csp"]

    def _route(self, route: Route) -> None:
        if self._outside(route.request.url):
            self.blocked.append(route.request.url)
            route.abort("internetdisconnected")
        else:
            route.continue_()

    def _on_request(self, request: BrowserRequest) -> None:
        if self._outside(request.url):
            self.outside.append(request)


@pytest.fixture
def offline(browser: Browser) -> Iterator[Offline]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    # A cold load of a 1.7 MB script on a busy CI machine: generous, but still bounded.
    context.set_default_timeout(20_000)
    recorder = Offline(context)
    yield recorder
    context.close()


@pytest.mark.browser
def test_docs_and_redoc_render_with_the_network_cut_off(
    offline: Offline, settings: Settings, db: Database
) -> None:
    with serve(create_app(settings, db, auth=True)) as base_url:
        page = offline.context.new_page()
        page.on("pageerror", lambda exc: offline.errors.append(f"{page.url}: {exc}"))

        page.goto(base_url + "/docs")
        # Swagger UI draws the title from /openapi.json, then one block per operation.
        info = page.locator(".swagger-ui .information-container .title")
        expect(info).to_contain_text("Halfway", timeout=20_000)
        expect(page.locator(".swagger-ui .opblock").first).to_be_visible()
        expect(page.locator(".swagger-ui .opblock-summary-path").first).to_contain_text("/v1/")

        page.goto(base_url + "/redoc")
        # ReDoc draws the API's title as its first heading and a menu entry per operation.
        expect(page.locator(".api-info h1")).to_contain_text("Halfway", timeout=20_000)
        expect(page.locator(".api-content")).to_contain_text("/v1/jobs")
        expect(page.locator("[role=menuitem]").first).to_be_visible()

    assert offline.blocked == [], "the pages tried to reach the internet"
    assert offline.left() == [], "requests left loopback"
    assert offline.errors == [], "script errors on the pages"
