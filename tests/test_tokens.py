"""Tokens end when an operator says so: a replaced token, a removed or disabled user is refused
at once by every API process on the database (two real `halfway serve` processes here, the
real `halfway users` command between them); polls with a good token still cost no query; and
failed authentication is limited per client address without a query per bad token."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.routes import history as history_routes
from service.database.db import Database
from service.people import auth
from service.people.authcache import AUTH_RECHECK_SECONDS, FailureLimiter
from service.settings import Settings
from tests.apiprocess import HALFWAY, ApiProcess
from tests.conftest import Team
from tests.live import Live


@pytest.fixture
def two_apis(db_url: str, team: Team, tmp_path: Path) -> Iterator[list[ApiProcess]]:
    apis = [ApiProcess(db_url, tmp_path / f"api{i}") for i in range(2)]
    try:
        for api in apis:
            api.wait_ready()
        yield apis
    finally:
        for api in apis:
            api.stop()


def users(db_url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HALFWAY_HOME": str(tmp_path / "cli"), "HALFWAY_DATABASE_URL": db_url}
    return subprocess.run(
        [HALFWAY, "users", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_a_replaced_token_is_refused_at_once_by_every_api_process(
    two_apis: list[ApiProcess], team: Team, db_url: str, tmp_path: Path
) -> None:
    # Both processes have verified (and cached) alice's token.
    assert [api.status(team.alice) for api in two_apis] == [200, 200]
    done = users(db_url, tmp_path, "token", "alice")
    assert done.returncode == 0, done.stderr
    new = done.stdout.strip()
    assert re.fullmatch(r"hw_[A-Za-z0-9_-]{43}", new), done.stdout
    assert "old token no longer works" in done.stderr
    # The moment the command has returned: refused everywhere, the new one accepted.
    assert [api.status(team.alice) for api in two_apis] == [401, 401]
    assert [api.status(new) for api in two_apis] == [200, 200]
    assert [api.status(team.bob) for api in two_apis] == [200, 200]
    assert users(db_url, tmp_path, "token", "nobody").returncode == 1


def test_disabled_and_removed_users_are_refused_at_once_by_every_api_process(
    two_apis: list[ApiProcess], team: Team, db_url: str, tmp_path: Path
) -> None:
    first, second = two_apis
    job = httpx.post(
        f"{first.url}/v1/jobs", json={"name": "bobs"}, headers=Team.header(team.bob), timeout=10
    ).json()["id"]
    assert [api.status(team.bob) for api in two_apis] == [200, 200]

    assert users(db_url, tmp_path, "disable", "bob").returncode == 0
    assert [api.status(team.bob) for api in two_apis] == [401, 401]
    r = httpx.get(f"{second.url}/v1/jobs", headers=Team.header(team.bob), timeout=10)
    assert "disabled" in r.json()["message"]
    assert [api.status(team.alice) for api in two_apis] == [200, 200]

    assert users(db_url, tmp_path, "enable", "bob").returncode == 0
    assert [api.status(team.bob) for api in two_apis] == [200, 200]

    removed = users(db_url, tmp_path, "remove", "bob")
    assert removed.returncode == 0, removed.stderr
    assert [api.status(team.bob) for api in two_apis] == [401, 401]
    # Bob's job stays, owned by his name.
    r = httpx.get(f"{second.url}/v1/jobs/{job}", headers=Team.header(team.alice), timeout=10)
    assert r.status_code == 200 and r.json()["owner"] == "bob"
    assert users(db_url, tmp_path, "remove", "bob").returncode == 1
    assert users(db_url, tmp_path, "disable", "bob").returncode == 1


def test_polls_with_a_good_token_cost_at_most_one_query_per_recheck_window(
    settings: Settings, db: Database, team: Team
) -> None:
    app = create_app(settings, db)
    with TestClient(app) as client:
        job = client.post("/v1/jobs", json={}, headers=Team.header(team.alice)).json()["id"]
        cache = app.state.auth_cache
        before, start, polls = cache.queries, time.monotonic(), 0
        while time.monotonic() - start < 3 * AUTH_RECHECK_SECONDS:
            r = client.get(f"/v1/jobs/{job}", headers=Team.header(team.alice))
            assert r.status_code == 200
            polls += 1
        elapsed = time.monotonic() - start
    queries = cache.queries - before
    assert polls > 50  # enough polls for the bound below to mean something
    assert queries <= elapsed / AUTH_RECHECK_SECONDS + 2, (queries, polls, elapsed)


def test_two_apps_on_one_database_see_a_change_made_through_the_other(
    settings: Settings, db: Database, team: Team
) -> None:
    """The mechanism without processes: the change is committed by a session of its own, then
    the settle window passes, then both apps refuse the old token."""
    apps = [create_app(settings, db), create_app(settings, db)]
    with TestClient(apps[0]) as one, TestClient(apps[1]) as two:
        for c in (one, two):
            assert c.get("/v1/jobs", headers=Team.header(team.alice)).status_code == 200
        with db.write() as s:
            new = auth.rotate_token(s, "alice")
        time.sleep(AUTH_RECHECK_SECONDS)
        for c in (one, two):
            assert c.get("/v1/jobs", headers=Team.header(team.alice)).status_code == 401
            assert c.get("/v1/jobs", headers=Team.header(new)).status_code == 200


def _limited_app(settings: Settings, db: Database, burst: int) -> tuple[TestClient, TestClient]:
    settings.auth_failure_burst, settings.auth_failures_per_second = burst, 0.01
    app = create_app(settings, db)
    return TestClient(app, client=("10.0.0.1", 1000)), TestClient(app, client=("10.0.0.2", 1000))


def test_failed_authentication_is_limited_per_address_without_a_query_per_bad_token(
    settings: Settings, db: Database, team: Team
) -> None:
    attacker, colleague = _limited_app(settings, db, burst=5)
    with attacker, colleague:
        app = attacker.app
        cache = app.state.auth_cache  # type: ignore[attr-defined]
        # Alice's token is good and already seen from the attacker's address.
        assert attacker.get("/v1/jobs", headers=Team.header(team.alice)).status_code == 200
        bad = [auth.new_token() for _ in range(5)]
        before = cache.queries
        for token in bad:
            assert attacker.get("/v1/jobs", headers=Team.header(token)).status_code == 401
        assert cache.queries - before <= 5 + 1  # one lookup each (and maybe one recheck)
        before = cache.queries
        for _ in range(50):
            r = attacker.get("/v1/jobs", headers=Team.header(auth.new_token()))
            assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"] == "too_many_requests"
        assert cache.queries - before <= 1  # the 50 refusals cost no lookups
        # A good token this process has verified still works from that address; another
        # address is not limited by the first one's failures.
        assert attacker.get("/v1/jobs", headers=Team.header(team.alice)).status_code == 200
        assert colleague.get("/v1/jobs", headers=Team.header(bad[0])).status_code == 401
        assert colleague.get("/v1/jobs", headers=Team.header(team.bob)).status_code == 200


def test_a_repeated_bad_token_costs_one_lookup(
    settings: Settings, db: Database, team: Team
) -> None:
    client, _ = _limited_app(settings, db, burst=1000)
    with client:
        cache = client.app.state.auth_cache  # type: ignore[attr-defined]
        bad = auth.new_token()
        assert client.get("/v1/jobs", headers=Team.header(bad)).status_code == 401
        before = cache.queries
        for _ in range(30):
            assert client.get("/v1/jobs", headers=Team.header(bad)).status_code == 401
        assert cache.queries - before <= 1  # at most a recheck of the generation


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_failure_limiter_refills_at_its_rate_and_stays_bounded() -> None:
    clock = FakeClock()
    limiter = FailureLimiter(3, 0.5, clock=clock, max_clients=4)
    for _ in range(3):
        assert limiter.retry_after("a") is None
        limiter.fail("a")
    assert limiter.retry_after("a") == 2  # one more failure needs 1 / 0.5 s
    clock.now += 1.0
    assert limiter.retry_after("a") == 1
    clock.now += 1.0
    assert limiter.retry_after("a") is None
    limiter.fail("a")
    assert limiter.retry_after("a") == 2
    clock.now += 60
    assert limiter.retry_after("a") is None  # refilled to the burst, not beyond
    for _ in range(3):
        limiter.fail("a")
    assert limiter.retry_after("a") is not None
    for i in range(100):
        limiter.fail(f"client-{i}")
    assert len(limiter._buckets) <= 4


def test_an_open_event_stream_ends_when_its_token_is_replaced(
    live: Live, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history_routes, "SSE_POLL_SECONDS", 0.05)
    job = live.submit({"name": "never runs"})  # queued, no worker: its stream never ends
    headers = Team.header(live.team.alice)
    timeout = httpx.Timeout(10.0, read=AUTH_RECHECK_SECONDS * 8)
    with httpx.stream(
        "GET", f"{live.url}/v1/jobs/{job}/events", headers=headers, timeout=timeout
    ) as stream:
        lines = stream.iter_lines()
        assert next(lines) == "event: status"
        with db.write() as s:
            auth.rotate_token(s, "alice")
        replaced = time.monotonic()
        rest = list(lines)  # the server closes the stream; a read timeout fails the test
    assert time.monotonic() - replaced < AUTH_RECHECK_SECONDS * 4
    assert not any(line.startswith("event: steps") for line in rest)
    r = httpx.get(f"{live.url}/v1/jobs/{job}/events", headers=headers, timeout=10)
    assert r.status_code == 401
