"""The FastAPI application. Built by ``create_app`` from settings at the entry point; nothing
here touches a database or TensorFlow at import time."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.gzip import DEFAULT_EXCLUDED_CONTENT_TYPES, GZipMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api import docs_pages, openapi
from service.api.feeds import Feeds
from service.api.leanpolls import GZIP_LEVEL, GZIP_MINIMUM_SIZE, HalfwayAPI, LeanPolls
from service.api.pollcache import PollCache
from service.api.routes import (
    artifacts,
    code,
    dashboard,
    datasets,
    epochs,
    export,
    gradients,
    history,
    jobs,
    meta,
    queue,
    sweeps,
)
from service.database.db import Database
from service.errors import HalfwayError, SpecError, TooManyRequests
from service.files.storage import StorageUnavailable
from service.metrics import MetricsRegistry, ObserveRequests, metrics_response
from service.people.authcache import AuthCache, FailureLimiter
from service.recording.columnar import EXPORT_MEDIA_TYPES
from service.settings import Settings
from service.specs.schemas import LEGACY_AMP_ENV

log = logging.getLogger("halfway.api")

# Pydantic puts a discriminated union's tag in an error's location (data.synthetic.samples);
# users wrote data.samples, so the tag is dropped.
_UNION_TAGS = {"mlp", "cnn", "transformer", "keras", "synthetic", "npz"}
# A plain union (``bool | Literal["auto"]``) puts the member's type in the location
# (training.jit_compile.bool); the field is what the user wrote.
_UNION_MEMBER = re.compile(r"^(bool|int|float|str|none|(literal|list|dict|function-\w+)\[.*\])$")


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    cleaned: list[str] = []
    for i, part in enumerate(parts):
        if i > 0 and parts[i - 1] in ("model", "data") and part in _UNION_TAGS:
            continue
        if i > 0 and isinstance(part, str) and _UNION_MEMBER.match(part):
            continue
        cleaned.append(str(part))
    return ".".join(cleaned)


def _validation_fields(exc: RequestValidationError) -> list[dict[str, str]]:
    fields = []
    for err in exc.errors():
        field = _field_path(tuple(err.get("loc", ())))
        if err.get("type") == "legacy_env_var":
            field = LEGACY_AMP_ENV
        message = str(err.get("msg", "invalid"))
        if err.get("type") == "json_invalid":
            # FastAPI puts the character offset in the location; the field is the body.
            where = err.get("loc", ())[-1]
            field = "body"
            message = f"invalid JSON: {(err.get('ctx') or {}).get('error', 'cannot parse')}"
            if isinstance(where, int):
                message += f" (at character {where})"
        fields.append({"field": field or "body", "rule": str(err.get("type")), "message": message})
    return fields


def _error(
    status: int, code: str, message: str, fields: list[dict[str, str]] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": code, "message": message, "fields": fields or []}, status_code=status
    )


def _too_large_error(message: str) -> JSONResponse:
    fields = [{"field": "body", "rule": "too_large", "message": message}]
    return _error(413, "payload_too_large", message, fields)


class BodySizeLimit:
    """Refuse a body over the limit with 413 before anything parses it, whether or not the
    client sent Content-Length."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, overrides: dict[str, int] | None = None
    ) -> None:
        self.app, self.default = app, max_bytes
        self.overrides = overrides or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.overrides.get(scope.get("path", ""), self.default)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._reject(send, limit)
                return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send, limit)

    async def _reject(self, send: Send, limit: int) -> None:
        response = _too_large_error(_TooLarge(limit).detail)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": response.body})


class _TooLarge(StarletteHTTPException):
    """Raised by ``receive`` once a streamed (chunked) body passes the limit. An HTTPException,
    because FastAPI's body reader re-raises those and turns anything else into a 400."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds {limit} bytes")


def _too_large(exc: BaseException | None) -> _TooLarge | None:
    """The limit's exception behind FastAPI's 400: the metrics middleware reads the body in a
    task group, which wraps what ``receive`` raised in an ExceptionGroup."""
    if isinstance(exc, _TooLarge):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _too_large(inner)) is not None:
                return found
    return None


def _unparseable(exc: StarletteHTTPException) -> str:
    cause = exc.__cause__
    if isinstance(cause, RecursionError):
        return "the JSON is nested too deeply to parse"
    if isinstance(cause, UnicodeError):
        return "the body is not valid UTF-8 text"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return "the JSON holds a number literal too long to parse"
    return str(exc.detail)


def allowed_methods(app: FastAPI, path: str, starlette_allow: str | None) -> str:
    """Every method the path answers. Starlette's own 405 names only the first route whose path
    matched, and FastAPI makes one route per method (GET and PATCH /v1/jobs/{id} are two), so
    its Allow header left methods out. The documented operations are the API's routes; a route
    outside the schema (the dashboard, the static files) keeps Starlette's answer."""
    methods = {m.strip() for m in (starlette_allow or "").split(",") if m.strip()}
    for pattern, verbs in _operation_patterns(app):
        if pattern.fullmatch(path):
            methods |= verbs
    return ", ".join(sorted(methods))


def _operation_patterns(app: FastAPI) -> list[tuple[re.Pattern[str], set[str]]]:
    cached: list[tuple[re.Pattern[str], set[str]]] | None = getattr(
        app.state, "operation_patterns", None
    )
    if cached is None:
        cached = []
        for template, operations in app.openapi()["paths"].items():
            regex = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
            cached.append((re.compile(regex), {m.upper() for m in operations}))
        app.state.operation_patterns = cached
    return cached


def create_app(
    settings: Settings,
    db: Database,
    *,
    auth: bool = True,
    on_startup: Callable[[], None] | None = None,
    on_shutdown: Callable[[], None] | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_startup is not None:
            on_startup()
        try:
            yield
        finally:
            if on_shutdown is not None:
                on_shutdown()

    app = HalfwayAPI(
        title="Halfway",
        version="1",
        description="Mixed-precision Keras training as a service, with every step's loss "
        "scale on record.",
        lifespan=lifespan,
        # FastAPI's own /docs and /redoc load their assets from CDNs; docs_pages serves the
        # same pages from files shipped in the package.
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.db = db
    app.state.auth = auth
    app.state.auth_cache = AuthCache(
        db, FailureLimiter(settings.auth_failure_burst, settings.auth_failures_per_second)
    )
    app.state.poll_cache = PollCache(settings.poll_cache_seconds)
    app.state.feeds = Feeds(db)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        fields = _validation_fields(exc)
        summary = "; ".join(f"{f['field']}: {f['message']}" for f in fields[:5])
        return _error(422, "validation_error", summary, fields)

    @app.exception_handler(HalfwayError)
    async def _domain(_: Request, exc: HalfwayError) -> JSONResponse:
        fields = getattr(exc, "fields", None)
        if isinstance(exc, SpecError):
            fields = [{"field": exc.field, "rule": exc.rule, "message": exc.detail}]
        response = _error(exc.status_code, exc.code, exc.message, fields)
        if exc.status_code == 401:
            response.headers["WWW-Authenticate"] = "Bearer"
        if isinstance(exc, TooManyRequests):
            response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        too_large = exc if exc.status_code == 413 else _too_large(exc.__cause__)
        if too_large is not None:
            return _too_large_error(str(too_large.detail))
        if exc.status_code == 400:
            # FastAPI and Starlette raise a 400 only for a body they cannot parse (bytes that
            # are not UTF-8, JSON nested past the recursion limit, an integer literal of over
            # 4300 digits, broken multipart). Like malformed JSON, that is a 422 naming the body.
            message = _unparseable(exc)
            return _error(
                422,
                "validation_error",
                f"body: {message}",
                [{"field": "body", "rule": "unparseable", "message": message}],
            )
        response = _error(exc.status_code, "http_error", str(exc.detail))
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            allow = exc.headers.get("Allow") if exc.headers else None
            response.headers["Allow"] = allowed_methods(app, request.url.path, allow)
        return response

    @app.exception_handler(OperationalError)
    async def _database_down(_: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database unavailable: %s", exc.orig)
        return _error(503, "database_unavailable", "the database is unavailable; retry shortly")

    @app.exception_handler(StorageUnavailable)
    async def _storage_down(_: Request, exc: StorageUnavailable) -> JSONResponse:
        log.warning("object store unavailable: %s", exc)
        return _error(503, "storage_unavailable", "the object store is unavailable; retry shortly")

    registry = MetricsRegistry(db)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return metrics_response(registry)

    app.include_router(jobs.router)
    app.include_router(history.router)
    app.include_router(export.router)
    app.include_router(gradients.router)
    app.include_router(epochs.router)
    app.include_router(meta.router)
    app.include_router(artifacts.router)
    app.include_router(datasets.router)
    app.include_router(sweeps.router)
    app.include_router(code.router)
    app.include_router(dashboard.router)
    queue.install(app, settings)
    dashboard.mount_static(app)
    openapi.install(app)
    docs_pages.install(app)
    # Bucket pages for long jobs run to hundreds of kilobytes of JSON and compress well.
    # Level 1 because it is about ten times cheaper than level 9 for a slightly larger result
    # (docs/decisions.md). Starlette leaves text/event-stream alone, so the event stream is
    # not delayed. Arrow and Parquet are left alone: gzip would shrink a million-row Arrow
    # stream a few times (Parquet is compact already) but take longer than sending it on a LAN.
    app.add_middleware(
        GZipMiddleware,
        minimum_size=GZIP_MINIMUM_SIZE,
        compresslevel=GZIP_LEVEL,
        exclude_content_types=(*DEFAULT_EXCLUDED_CONTENT_TYPES, *EXPORT_MEDIA_TYPES),
    )
    app.add_middleware(ObserveRequests)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        overrides={
            "/v1/datasets": settings.max_upload_bytes,
            # An archive is at most its unpacked size, plus the multipart envelope.
            "/v1/code": settings.max_code_bytes + 65_536,
        },
    )
    if settings.lean_polls:
        app.lean = LeanPolls(app)
    return app
