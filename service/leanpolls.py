"""Dashboards' polls answered before FastAPI's routing and dependency injection.

A poll of a job, or of its history after a cursor, that the poll cache can answer costs no
query, yet going through the router, the dependency solver and a Request and Response object
costs several times the answer itself; with a few hundred dashboards polling every second
that overhead, on the server's cores, is what slows the training beside it. This middleware
recognizes exactly those polls (a canonical path and query, a bearer token this process has
verified under the current auth generation, a fresh snapshot) and answers them from the
cache with the same bytes and headers the routes would send. Every other request, and every
poll it is not sure of, goes on to the app unchanged: it never answers an error itself.

It is the outermost middleware, since each layer costs a noticeable part of such an answer,
so it does itself what the layers inside would do to the routes' answer: the request latency
metric, labelled by route, and gzip for a large body when the client accepts it (each
compressed body is kept with its snapshot, so two hundred browsers cost one compression).
"""

from __future__ import annotations

import re
import time
import zlib

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from service.authcache import AuthCache
from service.deps import MAX_ID
from service.etag import matches
from service.metrics import REQUEST_LATENCY
from service.pages import PageKind, cached_page
from service.pollcache import PollCache
from service.routes.export import MAX_ROWS_PER_PAGE, MAX_STEP
from service.routes.history import MAX_ROWS

JOB_PATH = "/v1/jobs/{job_id}"
HISTORY_PATH = "/v1/jobs/{job_id}/history"
_PATH = re.compile(r"/v1/jobs/([1-9][0-9]{0,9})(/history)?")
# The compression app.py applies to the routes' answers (GZipMiddleware's settings).
GZIP_MINIMUM_SIZE = 1024
GZIP_LEVEL = 1
_GZIPPED_KEPT = 256
# Only what the routes would parse to the same value: plain decimal integers without a sign
# other than a leading minus, no leading zeros, and the two formats by name.
_ITEM = re.compile(r"(after_step|limit)=(-?[1-9][0-9]{0,9}|0)|format=(rows|columns)")


class LeanPolls:
    def __init__(self, app: ASGIApp, api: FastAPI) -> None:
        self.app = app
        self.api = api
        self._gzipped: dict[str, bytes] = {}  # by ETag: a body is compressed once

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET":
            started = time.perf_counter()
            answer = self._answer(scope)
            if answer is not None:
                status = await self._send(scope, send, *answer[1:])
                REQUEST_LATENCY.labels("GET", answer[0], str(status)).observe(
                    time.perf_counter() - started
                )
                return
        await self.app(scope, receive, send)

    def _answer(self, scope: Scope) -> tuple[str, bytes, str] | None:
        """(route template, body, ETag) when the poll cache answers this request as the
        route would, else None."""
        found = _PATH.fullmatch(scope["path"])
        if found is None or _has_body(scope):
            return None
        job_id = int(found.group(1))
        if job_id > MAX_ID or not self._authorized(scope):
            return None
        cache: PollCache = self.api.state.poll_cache
        if found.group(2) is None:
            if scope["query_string"]:
                return None
            snap = cache.fresh(job_id)
            return None if snap is None else (JOB_PATH, snap.body, snap.etag)
        query = _history_query(scope["query_string"])
        if query is None:
            return None
        cached = cached_page(cache, job_id, *query)
        return None if cached is None else (HISTORY_PATH, *cached)

    def _authorized(self, scope: Scope) -> bool:
        if not self.api.state.auth:
            return True
        header = _header(scope, b"authorization")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        auth_cache: AuthCache = self.api.state.auth_cache
        return auth_cache.known(token.strip()) is not None

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
