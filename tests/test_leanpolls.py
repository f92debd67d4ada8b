"""The lean poll path (service/api/leanpolls.py) answers a dashboard's polls before FastAPI's
routing. It must be invisible: the same status, headers and bytes as the routes for every
request, the same refusals for every token the routes would refuse, and the same metrics.
Each test compares an app with the lean path against one without it, on the same database."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.leanpolls import LeanPolls
from service.database.db import Database
from service.database.models import Job, utcnow
from service.people import auth
from service.people.authcache import settle
from service.recording import history
from service.recording.records import StepRecord
from service.settings import Settings
from tests.conftest import Team

IGNORED_HEADERS = {"date", "server"}
IDENTITY = {"Accept-Encoding": "identity"}


@dataclass
class Pair:
    lean: TestClient
    plain: TestClient
    job_id: int
    last_step: int


def _steps(n: int) -> list[StepRecord]:
    """Every kind of row a page must carry: finite losses, NaN, both infinities, overflowed
    steps, and a gap in the step numbers (a skipped step)."""
    records = []
    for step in [*range(0, 30), *range(31, n + 1)]:
        loss = 1.0 / (step + 1)
        if step == 7:
            loss = math.nan
        elif step == 8:
            loss = math.inf
        elif step == 9:
            loss = -math.inf
        records.append(StepRecord(step, step // 20, loss, 2.0 ** (15 - step % 3), step % 11 != 5))
    return records


@pytest.fixture
def pair(settings: Settings, db: Database, team: Team) -> Iterator[Pair]:
    # Snapshots that outlive the test: both apps must answer from their caches throughout.
    settings.poll_cache_seconds = 60
    plain_settings = settings.model_copy(update={"lean_polls": False})
    with (
        TestClient(create_app(settings, db)) as lean,
        TestClient(create_app(plain_settings, db)) as plain,
    ):
        lean.headers.update(Team.header(team.alice))
        plain.headers.update(Team.header(team.alice))
        r = lean.post("/v1/jobs", json={})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        records = _steps(80)
        with db.write() as s:
            job = s.get(Job, job_id)
            assert job is not None
            history.write_steps(s, job, records, now=utcnow())
        yield Pair(lean, plain, job_id, records[-1].step)


def _answer(
    client: TestClient, url: str, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    r = client.get(url, headers=headers)
    kept = {k: v for k, v in r.headers.items() if k not in IGNORED_HEADERS}
    return r.status_code, kept, r.content


def _polls(p: Pair) -> list[str]:
    j = f"/v1/jobs/{p.job_id}"
    last = p.last_step
    return [
        j,
        f"{j}/history",
        f"{j}/history?after_step=-1&limit=1000",
        f"{j}/history?limit=1000&after_step=-1",
        f"{j}/history?after_step=40&limit=5",
        f"{j}/history?after_step={last}&limit=1000",
        f"{j}/history?after_step={last + 100}",
        f"{j}/history?format=columns",
        f"{j}/history?format=columns&after_step=-1&limit=1000000",
        f"{j}/history?format=rows&after_step={last}",
        f"{j}/history?points=10",
        f"{j}/history?points=1000",
        f"{j}/history?points=5000&from_step=0&to_step=2147483647",
        f"{j}/history?to_step=60&points=7&from_step=12",
        f"{j}/history?points=3&from_step={last + 10}",
        "/v1/jobs",
        "/v1/jobs?limit=100",
        "/v1/jobs?limit=1",
        "/v1/jobs?limit=200",
    ]


def _others(p: Pair) -> list[str]:
    """Requests the lean path must leave to the routes, whatever they answer."""
    j = f"/v1/jobs/{p.job_id}"
    return [
        f"{j}/history?after_step=01",
        f"{j}/history?after_step=+1",
        f"{j}/history?after_step=-2",
        f"{j}/history?after_step=2147483648",
        f"{j}/history?limit=0",
        f"{j}/history?limit=10001",
        f"{j}/history?format=columns&limit=1000001",
        f"{j}/history?limit=5&limit=6",
        f"{j}/history?points=0",
        f"{j}/history?points=5001",
        f"{j}/history?points=010",
        f"{j}/history?points=10&points=11",
        f"{j}/history?points=10&from_step=-1",
        f"{j}/history?points=10&from_step=50&to_step=49",
        f"{j}/history?points=10&to_step=2147483648",
        f"{j}/history?points=10&after_step=5",
        f"{j}/history?points=10&format=columns",
        f"{j}/history?after_step=-1&foo=1",
        f"{j}/history?format=csv",
        f"{j}?x=1",
        "/v1/jobs/0",
        "/v1/jobs/2147483648",
        "/v1/jobs/99999",
        "/v1/jobs/99999/history",
        "/v1/jobs/99999/history?points=10",
        f"/v1/jobs/0{p.job_id}",
        "/v1/jobs?limit=0",
        "/v1/jobs?limit=201",
        "/v1/jobs?limit=050",
        "/v1/jobs?limit=5&limit=6",
        "/v1/jobs?status=running",
        "/v1/jobs?owner=alice",
        "/v1/jobs?cursor=3",
        "/v1/jobs?limit=10&cursor=3",
        "/v1/jobs/",
    ]


def _warm(p: Pair, urls: list[str]) -> None:
    """Each app's first answer to a poll fills its cache (snapshot, page) from the database."""
    for url in urls:
        for client in (p.lean, p.plain):
            client.get(url)


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
def test_every_poll_gets_the_routes_bytes_and_headers(pair: Pair, encoding: str) -> None:
    urls = _polls(pair) + _others(pair)
    _warm(pair, urls)
    headers = {"Accept-Encoding": encoding}
    compressed = 0
    for url in urls:
        lean = _answer(pair.lean, url, headers)
        assert lean == _answer(pair.plain, url, headers), url
        compressed += lean[1].get("content-encoding") == "gzip"
        etag = lean[1].get("etag")
        if etag is not None:
            conditional = {**headers, "If-None-Match": etag}
            again = _answer(pair.lean, url, conditional)
            assert again == _answer(pair.plain, url, conditional), url
            assert again[0] == 304, url
    # The rows make pages large enough to be compressed, so both branches were compared.
    assert (compressed > 0) == (encoding == "gzip")


def _scope(url: str, token: str) -> dict[str, Any]:
    path, _, query = url.partition("?")
    return {
        "type": "http",
        "method": "GET",
        "path": path,
        "query_string": query.encode(),
        "headers": [(b"authorization", f"Bearer {token}".encode())],
    }


def test_the_lean_path_answers_the_polls_and_leaves_the_rest(pair: Pair, team: Team) -> None:
    """The comparison above would hold as well if the lean path never answered: these are the
    requests it must answer itself, and those it must leave to the routes. Nothing is cached
    but the token (verified by one request that is not a poll): the lean path reads a stale
    snapshot and a page no poller has read yet itself, as the routes would."""
    assert pair.lean.get("/v1/jobs").status_code == 200
    lean = LeanPolls(pair.lean.app)  # type: ignore[arg-type]

    def answer(url: str, token: str = team.alice) -> object:
        return asyncio.run(lean._answer(_scope(url, token)))

    for url in _polls(pair):
        assert answer(url) is not None, url
    for url in _others(pair):
        assert answer(url) is None, url
    assert answer(_polls(pair)[0], "hw_not-a-token") is None
    assert answer(_polls(pair)[0], team.bob) is None  # a token this process has not verified


def test_a_token_taken_away_is_refused_although_its_polls_are_cached(
    pair: Pair, db: Database, team: Team
) -> None:
    url = f"/v1/jobs/{pair.job_id}"
    assert pair.lean.get(url).status_code == 200
    etag = pair.lean.get(url).headers["etag"]
    assert pair.lean.get(url, headers={"If-None-Match": etag}).status_code == 304
    with db.write() as s:
        assert auth.set_disabled(s, "alice", True)
    settle()
    for poll in (url, f"{url}/history?after_step={pair.last_step}"):
        r = pair.lean.get(poll, headers={"If-None-Match": etag})
        assert r.status_code == 401, (poll, r.status_code)
    # Another member's token still polls, from the same cached snapshot.
    r = pair.lean.get(url, headers={**Team.header(team.bob), "If-None-Match": etag})
    assert r.status_code == 304


def _count(metrics: str, route: str, status: int) -> float:
    pattern = (
        r'halfway_http_request_duration_seconds_count\{method="GET",route="'
        + re.escape(route)
        + r'",status="'
        + str(status)
        + r'"\} ([0-9.e+]+)'
    )
    found = re.search(pattern, metrics)
    return float(found.group(1)) if found else 0.0


def test_polls_answered_early_are_counted_by_route(pair: Pair) -> None:
    url = f"/v1/jobs/{pair.job_id}"
    etag = pair.lean.get(url).headers["etag"]
    before = pair.lean.get("/metrics").text
    for _ in range(7):
        assert pair.lean.get(url, headers={"If-None-Match": etag}).status_code == 304
    for _ in range(3):
        r = pair.lean.get(f"{url}/history?after_step={pair.last_step}", headers=IDENTITY)
        assert r.status_code == 200
    after = pair.lean.get("/metrics").text
    assert _count(after, "/v1/jobs/{job_id}", 304) - _count(before, "/v1/jobs/{job_id}", 304) == 7
    history_route = "/v1/jobs/{job_id}/history"
    assert _count(after, history_route, 200) - _count(before, history_route, 200) == 3


# --------------------------------------------------------------------------------------------
# The event stream: served before the routes too, with the route's headers and bytes.


def _streams(p: Pair) -> list[tuple[str, dict[str, str]]]:
    e = f"/v1/jobs/{p.job_id}/events"
    return [
        (e, {}),
        (f"{e}?after_step=-1", {}),
        (f"{e}?after_step=40", {}),
        (f"{e}?after_step={p.last_step + 50}", {}),
        (e, {"Last-Event-ID": "0:25"}),
        (f"{e}?after_step=70", {"Last-Event-ID": "0:12"}),
        (e, {"Last-Event-ID": "3:25"}),  # a version the job never had: from the start
        (e, {"Last-Event-ID": ""}),
    ]


def _other_streams(p: Pair) -> list[tuple[str, dict[str, str]]]:
    e = f"/v1/jobs/{p.job_id}/events"
    return [
        (f"{e}?after_step=01", {}),
        (f"{e}?after_step=-2", {}),
        (f"{e}?after_step=2147483648", {}),
        (f"{e}?after_step=1&after_step=2", {}),
        (f"{e}?foo=1", {}),
        (e, {"Last-Event-ID": "yesterday"}),
        ("/v1/jobs/99999/events", {}),
        ("/v1/jobs/0/events", {}),
    ]


def _streamed(client: TestClient, url: str, headers: dict[str, str]) -> tuple[Any, ...]:
    with client.stream("GET", url, headers=headers) as r:
        body = r.read()
        kept = {k: v for k, v in r.headers.items() if k not in IGNORED_HEADERS}
        return r.status_code, kept, body


def test_every_stream_gets_the_routes_headers_and_bytes(
    pair: Pair, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.api.routes import history as history_routes

    monkeypatch.setattr(history_routes, "SSE_POLL_SECONDS", 0.02)
    with db.write() as s:  # a finished job's streams end, so each can be read whole
        job = s.get(Job, pair.job_id)
        assert job is not None
        job.status = "succeeded"
    for client in (pair.lean, pair.plain):
        client.app.state.poll_cache.forget(pair.job_id)  # type: ignore[attr-defined]
    for url, headers in _streams(pair) + _other_streams(pair):
        lean = _streamed(pair.lean, url, headers)
        assert lean == _streamed(pair.plain, url, headers), (url, headers)
        if (url, headers) in _streams(pair):
            assert lean[0] == 200 and lean[2].endswith(b"\n\n") and b"event: end" in lean[2]


def test_the_lean_path_serves_the_streams_and_leaves_the_rest(pair: Pair, team: Team) -> None:
    assert pair.lean.get("/v1/jobs").status_code == 200  # alice's token verified
    lean = LeanPolls(pair.lean.app)  # type: ignore[arg-type]

    def target(url: str, headers: dict[str, str], token: str = team.alice) -> object:
        scope = _scope(url, token)
        scope["headers"] += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        return asyncio.run(lean._stream_target(scope))

    for url, headers in _streams(pair):
        assert target(url, headers) is not None, (url, headers)
    for url, headers in _other_streams(pair):
        assert target(url, headers) is None, (url, headers)
    assert target(*_streams(pair)[0], "hw_not-a-token") is None
    assert target(*_streams(pair)[0], team.bob) is None
    repeated = _scope(_streams(pair)[0][0], team.alice)
    repeated["headers"] += [(b"last-event-id", b"0:1"), (b"last-event-id", b"0:2")]
    assert asyncio.run(lean._stream_target(repeated)) is None
    assert target(f"/v1/jobs/{pair.job_id}/events?after_step=40", {}) == (pair.job_id, 40, None)
    assert target(_streams(pair)[0][0], {"Last-Event-ID": "2:7"}) == (pair.job_id, 7, 2)


# --------------------------------------------------------------------------------------------
# An open log panel's read at the log's end: answered before the routes too, the route's
# empty answer; any read with bytes to send goes to the route.


def test_a_log_read_at_its_end_gets_the_routes_answer_and_a_read_with_news_the_route(
    pair: Pair, settings: Settings, team: Team
) -> None:
    from service.api.routes.artifacts import artifact_store

    store = artifact_store(settings)
    key = f"{pair.job_id}/train.log"
    store.put_bytes(key, b"epoch 1\n")
    logs = f"/v1/jobs/{pair.job_id}/logs"
    lean = LeanPolls(pair.lean.app)  # type: ignore[arg-type]

    def at_end(url: str, token: str = team.alice) -> int | None:
        return asyncio.run(lean._log_end(_scope(url, token)))

    _warm(pair, ["/v1/jobs", f"/v1/jobs/{pair.job_id}"])
    for url in (f"{logs}?offset=8", f"{logs}?offset=0", f"{logs}?offset=9", logs, f"{logs}?tail=3"):
        assert _answer(pair.lean, url, IDENTITY) == _answer(pair.plain, url, IDENTITY), url
    assert at_end(f"{logs}?offset=8") == 8  # at the end: answered here
    for url in (
        f"{logs}?offset=0",  # bytes to send
        f"{logs}?offset=9",  # past the end: the route clamps it
        f"{logs}?offset=08",
        f"{logs}?offset=8&offset=8",
        f"{logs}?offset=8&tail=3",
        logs,
        "/v1/jobs/99999/logs?offset=0",  # no such job: the route's 404
    ):
        assert at_end(url) is None, url
    assert at_end(f"{logs}?offset=8", "hw_not-a-token") is None
    # The log grows: once the size read has aged, the old end is not the end any more, and
    # the route sends what was appended.
    store.put_bytes(key, b"epoch 1\nepoch 2\n")
    served = pair.lean.app.lean  # type: ignore[attr-defined]
    assert served is not None and served._log_sizes  # the app's own path kept the size too
    ttl = pair.lean.app.state.poll_cache.ttl  # type: ignore[attr-defined]
    for path in (lean, served):
        path._log_sizes = {j: (when - ttl, n) for j, (when, n) in path._log_sizes.items()}
    assert at_end(f"{logs}?offset=8") is None
    r = pair.lean.get(f"{logs}?offset=8", headers=IDENTITY)
    assert (r.content, r.headers["x-log-offset"]) == (b"epoch 2\n", "16")


def test_log_reads_at_the_end_are_counted_by_route(pair: Pair, settings: Settings) -> None:
    from service.api.routes.artifacts import artifact_store

    artifact_store(settings).put_bytes(f"{pair.job_id}/train.log", b"0123")
    url = f"/v1/jobs/{pair.job_id}/logs?offset=4"
    route = "/v1/jobs/{job_id}/logs"
    before = pair.lean.get("/metrics").text
    for _ in range(5):
        r = pair.lean.get(url, headers=IDENTITY)
        assert (r.status_code, r.content, r.headers["x-log-size"]) == (200, b"", "4")
    after = pair.lean.get("/metrics").text
    assert _count(after, route, 200) - _count(before, route, 200) == 5
