"""Dashboards' polls answered before FastAPI's routing and dependency injection.

A poll of a job, of its history after a cursor or in buckets, or of the job list's first
page, that the poll cache can answer costs no query (an open log panel's read at the log's
end, nothing appended, costs one look at the store per cache age for all its readers), yet
going through the router, the dependency solver and a Request and Response object costs
several times the answer itself; with a few hundred dashboards polling every second that
overhead, on the server's cores, is what slows the training beside it. This middleware
recognizes exactly those polls (a canonical path and query, a bearer token this process has
verified under the current auth generation, a fresh snapshot) and answers them from the
cache with the same bytes and headers the routes would send. Every other request, and
every poll it is not sure of, goes on to the app unchanged: it never answers an error
itself. When the snapshot has aged, or a page is not cached yet, it reads them as the routes
would, once for every poll waiting on them, so a poll never falls back to the routes' cost
merely because it arrived as the cache was refreshed.

It runs before FastAPI's own middleware and the app's (``HalfwayAPI``), since each layer costs
a noticeable part of such an answer, so it does itself what those layers would do to the
routes' answer: the request latency metric, labelled by route, and gzip for a large body when
the client accepts it (each compressed body is kept with its snapshot, so two hundred browsers
cost one compression).
"""

from __future__ import annotations

import asyncio
import re
import time
import zlib
from collections.abc import AsyncGenerator, Callable, Hashable
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from service.api.deps import MAX_ID
from service.api.etag import matches
from service.api.feeds import Feeds, stream
from service.api.pages import PageKind, cached_page, polled_page
from service.api.pollcache import ListKey, PageKey, PollCache
from service.api.routes import history as history_routes
from service.api.routes.artifacts import artifact_store
from service.api.routes.export import MAX_ROWS_PER_PAGE, MAX_STEP
from service.api.routes.history import (
    LAST_EVENT_ID,
    MAX_POINTS,
    MAX_ROWS,
    bucket_page,
    resume_point,
)
from service.api.routes.jobs import LIST_LIMIT, job_listing, job_snapshot
from service.files.storage import Store
from service.metrics import REQUEST_LATENCY
from service.people.authcache import AuthCache, token_still_good

T = TypeVar("T")

LIST_PATH = "/v1/jobs"
JOB_PATH = "/v1/jobs/{job_id}"
HISTORY_PATH = "/v1/jobs/{job_id}/history"
# The job list's polls it takes: the first page, with the default limit or one of 1..200.
_LIST_QUERY = re.compile(rb"(?:limit=([1-9][0-9]?|1[0-9][0-9]|200))?")
_PATH = re.compile(r"/v1/jobs/([1-9][0-9]{0,9})(/history)?")
LOGS_PATH = "/v1/jobs/{job_id}/logs"
_LOGS = re.compile(r"/v1/jobs/([1-9][0-9]{0,9})/logs")
_LOGS_QUERY = re.compile(rb"offset=(0|[1-9][0-9]{0,18})")
_LOG_SIZES_KEPT = 4096
EVENTS_PATH = "/v1/jobs/{job_id}/events"
_EVENTS = re.compile(r"/v1/jobs/([1-9][0-9]{0,9})/events")
_EVENTS_QUERY = re.compile(rb"(?:after_step=(-1|0|[1-9][0-9]{0,9}))?")
_LAST_EVENT_ID = re.compile(LAST_EVENT_ID)
# The route's headers, in its order (StreamingResponse puts the media type last).
_EVENTS_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
]
# The compression app.py applies to the routes' answers (GZipMiddleware's settings).
GZIP_MINIMUM_SIZE = 1024
GZIP_LEVEL = 1
_GZIPPED_KEPT = 256
# Only what the routes would parse to the same value: plain decimal integers without a sign
# other than a leading minus, no leading zeros, and the two formats by name.
_ITEM = re.compile(r"(after_step|limit)=(-?[1-9][0-9]{0,9}|0)|format=(rows|columns)")
_BUCKET_ITEM = re.compile(r"(points|from_step|to_step)=([1-9][0-9]{0,9}|0)")


class LeanPolls:
    """Called by ``HalfwayAPI`` for every request, before anything else."""

    def __init__(self, api: FastAPI) -> None:
        self.api = api
        self._gzipped: dict[str, bytes] = {}  # by ETag: a body is compressed once
        self._flights: dict[Hashable, asyncio.Future[Any]] = {}
        self._log_sizes: dict[int, tuple[float, int]] = {}  # job -> (when read, bytes)
        self._store: Store | None = None

    async def answered(self, scope: Scope, send: Send) -> bool:
        """Whether this request was a poll and has been answered."""
        if scope["type"] != "http" or scope["method"] != "GET":
            return False
        started = time.perf_counter()
        size = await self._log_end(scope)
        if size is not None:
            await _send_log_end(send, size)
            REQUEST_LATENCY.labels("GET", LOGS_PATH, "200").observe(time.perf_counter() - started)
            return True
        answer = await self._answer(scope)
        if answer is None:
            return False
        status = await self._send(scope, send, *answer[1:])
        REQUEST_LATENCY.labels("GET", answer[0], str(status)).observe(time.perf_counter() - started)
        return True

    async def streamed(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Whether this request was for a job's event stream and has been served. A stream
        sends every listener the same text each tick; through the routes, each of those
        sends also went through every middleware, which cost more than the send itself."""
        if scope["type"] != "http" or scope["method"] != "GET":
            return False
        target = await self._stream_target(scope)
        if target is None:
            return False
        started = time.perf_counter()
        token = _header(scope, b"authorization").partition(" ")[2].strip()
        client = scope["client"][0] if scope.get("client") else ""
        cache: AuthCache = self.api.state.auth_cache

        async def still_valid() -> bool:
            return not self.api.state.auth or await token_still_good(cache, token, client)

        feeds: Feeds = self.api.state.feeds
        chunks = stream(
            feeds,
            *target,
            history_routes.SSE_POLL_SECONDS,
            history_routes.SSE_KEEPALIVE_SECONDS,
            still_valid,
        )
        try:
            await _pump(receive, send, chunks)
        finally:
            REQUEST_LATENCY.labels("GET", EVENTS_PATH, "200").observe(time.perf_counter() - started)
        return True

    async def _stream_target(self, scope: Scope) -> tuple[int, int, int | None] | None:
        """(job id, after_step, history version) of a stream request the route would serve
        as is, for a verified token and a job that exists; else None."""
        found = _EVENTS.fullmatch(scope["path"])
        query = _EVENTS_QUERY.fullmatch(scope["query_string"])
        if found is None or query is None or _has_body(scope):
            return None
        job_id, after = int(found.group(1)), int(query.group(1) or -1)
        last_event_id = _header(scope, b"last-event-id")
        if job_id > MAX_ID or after > MAX_STEP or not _LAST_EVENT_ID.fullmatch(last_event_id):
            return None
        if _repeated(scope, b"last-event-id") or not await self._authorized(scope):
            return None
        version = None
        resumed = resume_point(last_event_id)
        if resumed is not None:
            version, after = resumed
        cache: PollCache = self.api.state.poll_cache
        try:  # the job exists (the route answers a 404 itself)
            if cache.fresh(job_id) is None:
                await self._shared(("job", job_id), job_snapshot, self.api.state.db, cache, job_id)
        except Exception:
            return None
        return job_id, after, version

    async def _answer(self, scope: Scope) -> tuple[str, bytes, str] | None:
        """(route template, body, ETag) when this is a poll the routes would answer from
        the poll cache, else None. A stale snapshot, or a page no poller at its cursor has
        read yet, is read here as the routes would read it, once for all the polls that
        wait for it; should that read fail, the routes take the request and answer it."""
        found = _PATH.fullmatch(scope["path"])
        cache: PollCache = self.api.state.poll_cache
        if scope["path"] == LIST_PATH and cache.ttl > 0 and not _has_body(scope):
            return await self._listing(scope, cache)
        if found is None or cache.ttl <= 0 or _has_body(scope):
            return None
        job_id = int(found.group(1))
        raw = scope["query_string"]
        query = _history_query(raw) if found.group(2) else None
        zoom = _bucket_query(raw) if found.group(2) and query is None else None
        if (found.group(2) is None and raw) or (found.group(2) and query is None and zoom is None):
            return None
        if job_id > MAX_ID or not await self._authorized(scope):
            return None
        db = self.api.state.db
        try:
            snap = cache.fresh(job_id)
            if snap is None:
                snap = await self._shared(("job", job_id), job_snapshot, db, cache, job_id)
            if zoom is not None:
                key: PageKey = ("buckets", job_id, *zoom)
                kept = cache.page(key, snap)
                if kept is None:
                    read = (key, snap.taken)
                    kept = await self._shared(read, bucket_page, db, cache, job_id, *zoom)
                return HISTORY_PATH, kept.body, kept.etag
            if query is None:
                return JOB_PATH, snap.body, snap.etag
            page = cached_page(cache, job_id, *query)
            if page is None:
                page = await self._shared(
                    (*query, job_id, snap.taken), polled_page, db, cache, job_id, *query
                )
        except Exception:  # a missing job, a database down: the routes answer and report it
            return None
        return HISTORY_PATH, *page

    async def _log_end(self, scope: Scope) -> int | None:
        """The log's size, when this is an open log panel's read at the log's end (its
        offset is the size the store gave within the poll cache's age) of a job that exists:
        the route's answer is then empty, and costs its routing, a query and a look at the
        store each time. Else None, and the route answers."""
        found = _LOGS.fullmatch(scope["path"])
        query = _LOGS_QUERY.fullmatch(scope["query_string"])
        cache: PollCache = self.api.state.poll_cache
        if found is None or query is None or cache.ttl <= 0 or _has_body(scope):
            return None
        job_id, offset = int(found.group(1)), int(query.group(1))
        if job_id > MAX_ID or not await self._authorized(scope):
            return None
        try:
            if cache.fresh(job_id) is None:  # the job exists (the route answers a 404)
                await self._shared(("job", job_id), job_snapshot, self.api.state.db, cache, job_id)
            size = await self._log_size(job_id, cache.ttl)
        except Exception:  # the store or the database is down: the route reports it
            return None
        return size if offset == size else None

    async def _log_size(self, job_id: int, ttl: float) -> int:
        """The job's log size in the store, read at most once per ``ttl`` for all readers."""
        now = time.monotonic()
        kept = self._log_sizes.get(job_id)
        if kept is not None and now - kept[0] < ttl:
            return kept[1]
        if self._store is None:
            self._store = artifact_store(self.api.state.settings)
        size = await self._shared(("log", job_id), _log_size, self._store, job_id)
        if len(self._log_sizes) >= _LOG_SIZES_KEPT:
            self._log_sizes.clear()
        self._log_sizes[job_id] = (now, size)
        return size

    async def _listing(self, scope: Scope, cache: PollCache) -> tuple[str, bytes, str] | None:
        """The job list's first page, as the list route would answer it."""
        query = _LIST_QUERY.fullmatch(scope["query_string"])
        if query is None or not await self._authorized(scope):
            return None
        key: ListKey = (None, None, None, int(query.group(1) or LIST_LIMIT))
        try:
            listing = cache.fresh_listing(key)
            if listing is None:
                listing = await self._shared(
                    ("list", key), job_listing, self.api.state.db, cache, key
                )
        except Exception:  # a database down: the route answers and reports it
            return None
        return LIST_PATH, listing.body, listing.etag

    async def _shared(self, key: Hashable, load: Callable[..., T], *args: Any) -> T:
        """``load(*args)`` in a thread, once for every poll that asks for ``key`` meanwhile."""
        flight = self._flights.get(key)
        if flight is None:
            flight = asyncio.ensure_future(run_in_threadpool(load, *args))
            self._flights[key] = flight
            flight.add_done_callback(lambda done: self._landed(key, done))
        # Shielded: a poller that hangs up must not cancel the read the others await.
        result: T = await asyncio.shield(flight)
        return result

    def _landed(self, key: Hashable, flight: asyncio.Future[Any]) -> None:
        self._flights.pop(key, None)
        if not flight.cancelled():
            flight.exception()  # retrieved: every waiter may have gone

    async def _authorized(self, scope: Scope) -> bool:
        if not self.api.state.auth:
            return True
        header = _header(scope, b"authorization")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return False
        auth_cache: AuthCache = self.api.state.auth_cache
        if auth_cache.known(token) is None:
            try:
                await auth_cache.current()  # the one shared read, if the generation is due
            except Exception:  # a database down: the routes answer and report it (a 503)
                return False
        return auth_cache.known(token) is not None

    async def _send(self, scope: Scope, send: Send, body: bytes, etag: str) -> int:
        headers = [(b"etag", etag.encode("latin-1")), (b"cache-control", b"no-cache")]
        if matches(_header(scope, b"if-none-match"), etag):
            await send({"type": "http.response.start", "status": 304, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return 304
        headers.append((b"content-type", b"application/json"))
        if len(body) >= GZIP_MINIMUM_SIZE:
            headers.append((b"vary", b"Accept-Encoding"))
            if "gzip" in _header(scope, b"accept-encoding"):
                body = self._gzip(body, etag)
                headers.append((b"content-encoding", b"gzip"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return 200

    def _gzip(self, body: bytes, etag: str) -> bytes:
        gzipped = self._gzipped.get(etag)
        if gzipped is None:
            compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
            gzipped = compressor.compress(body) + compressor.flush()
            if len(self._gzipped) >= _GZIPPED_KEPT:
                self._gzipped.clear()
            self._gzipped[etag] = gzipped
        return gzipped


class HalfwayAPI(FastAPI):
    """FastAPI with the lean poll path in front of its own middleware (each layer costs a
    noticeable part of a cached poll's answer)."""

    lean: LeanPolls | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.lean is not None and (
            await self.lean.answered(scope, send) or await self.lean.streamed(scope, receive, send)
        ):
            return
        await super().__call__(scope, receive, send)


async def _pump(receive: Receive, send: Send, chunks: AsyncGenerator[bytes, None]) -> None:
    """Send ``chunks`` as a streamed 200 until they end or the client goes away (the server
    says so through ``receive``: sending alone would not notice)."""

    async def sending() -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _EVENTS_HEADERS})
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pumping, watching = asyncio.ensure_future(sending()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pumping, watching):
            task.cancel()
        await asyncio.gather(pumping, watching, return_exceptions=True)
        await chunks.aclose()
    failed = None if pumping.cancelled() else pumping.exception()
    if failed is not None:  # the feed's read failed: the connection is dropped, as the route's
        raise failed


def _log_size(store: Store, job_id: int) -> int:
    return store.size(f"{job_id}/train.log") or 0


async def _send_log_end(send: Send, size: int) -> None:
    """The log route's answer at the log's end: no bytes, the offset to read on from."""
    at = str(size).encode()
    headers = [
        (b"x-log-offset", at),
        (b"x-log-size", at),
        (b"content-length", b"0"),
        (b"content-type", b"text/plain; charset=utf-8"),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def _repeated(scope: Scope, name: bytes) -> bool:
    return sum(1 for key, _ in scope["headers"] if key == name) > 1


def _has_body(scope: Scope) -> bool:
    for key, value in scope["headers"]:
        if key == b"transfer-encoding" or (key == b"content-length" and value != b"0"):
            return True
    return False


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def _history_query(raw: bytes) -> tuple[int, int, PageKind] | None:
    """(after_step, limit, format) of a row or column poll, with the routes' defaults and
    bounds; None for anything else (buckets, zooms, a repeated or unknown parameter)."""
    values: dict[str, str] = {}
    for item in raw.decode("latin-1").split("&") if raw else ():
        found = _ITEM.fullmatch(item)
        if found is None:
            return None
        name = item.partition("=")[0]
        if name in values:
            return None
        values[name] = item.partition("=")[2]
    kind: PageKind = "columns" if values.get("format") == "columns" else "rows"
    after_step = int(values.get("after_step", "-1"))
    limit = int(values.get("limit", "1000"))
    most = MAX_ROWS if kind == "rows" else MAX_ROWS_PER_PAGE
    if not (-1 <= after_step <= MAX_STEP and 1 <= limit <= most):
        return None
    return after_step, limit, kind


def _bucket_query(raw: bytes) -> tuple[int, int | None, int | None] | None:
    """(points, from_step, to_step) of a bucket poll, within the routes' bounds; None for
    anything else (a zoom the route refuses, a repeated or unknown parameter)."""
    values: dict[str, int] = {}
    for item in raw.decode("latin-1").split("&") if raw else ():
        found = _BUCKET_ITEM.fullmatch(item)
        if found is None or found.group(1) in values:
            return None
        values[found.group(1)] = int(found.group(2))
    points, lo, hi = values.get("points"), values.get("from_step"), values.get("to_step")
    if points is None or not 1 <= points <= MAX_POINTS:
        return None
    if any(v is not None and v > MAX_STEP for v in (lo, hi)):
        return None
    if lo is not None and hi is not None and hi < lo:
        return None
    return points, lo, hi
