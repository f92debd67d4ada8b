"""FastAPI dependencies: the database, one session per request, and the caller's identity."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.auth import LOCAL_PRINCIPAL, Principal, authenticate, hash_token
from service.db import Database
from service.errors import Unauthorized
from service.pollcache import PollCache
from service.settings import Settings

# Ids are INTEGER columns: 32-bit on PostgreSQL. A larger id in a URL is refused by validation
# (422) instead of reaching the database, where it overflows the column type (a 500).
MAX_ID = 2**31 - 1

# Declares the scheme in the OpenAPI document (so /docs and clients know to send a bearer
# token); ``current_principal`` below does the checking.
BEARER = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="An API token (`halfway users add`): Authorization: Bearer <token>",
)


# The lookups below are async although they never await: FastAPI runs a plain ``def``
# dependency in its thread pool, so as ``def`` each of them cost every request a thread hop
# (a seventh of the server's CPU under 200 polling dashboards, by py-spy).
async def get_db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def read_session(db: Annotated[Database, Depends(get_db)]) -> Iterator[Session]:
    with db.sessions() as session:
        yield session


def write_session(db: Annotated[Database, Depends(get_db)]) -> Iterator[Session]:
    """A session whose transaction starts with BEGIN IMMEDIATE on SQLite. The route commits
    before it responds, so a client that got a 2xx can always read what it wrote."""
    with db.write_sessions() as session:
        yield session


async def current_principal(
    request: Request,
    db: Annotated[Database, Depends(get_db)],
    _bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)],
) -> Principal:
    """Async: a token seen in the last half minute is checked on the event loop (a hash and
    a dictionary lookup); only an unknown one costs a query, in a thread."""
    if not request.app.state.auth:
        return LOCAL_PRINCIPAL
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    cache: TokenCache = request.app.state.token_cache
    key = hash_token(token.strip())
    principal = cache.get(key)
    if principal is None:
        principal = await run_in_threadpool(_authenticate, db, token.strip())
        if principal is None:
            raise Unauthorized("invalid token")
        cache.put(key, principal)
    return principal


def _authenticate(db: Database, token: str) -> Principal | None:
    with db.sessions() as session:
        return authenticate(session, token)


class TokenCache:
    """Recently verified tokens (by hash), so a dashboard polling every second does not cost a
    user lookup per request. A removed user's token stops working within ``ttl`` seconds."""

    def __init__(self, ttl: float = 30.0, size: int = 1024) -> None:
        self.ttl, self.size = ttl, size
        self._items: dict[str, tuple[float, Principal]] = {}

    def get(self, key: str) -> Principal | None:
        item = self._items.get(key)
        if item is None or time.monotonic() - item[0] > self.ttl:
            return None
        return item[1]

    def put(self, key: str, principal: Principal) -> None:
        if len(self._items) >= self.size:
            self._items.clear()
        self._items[key] = (time.monotonic(), principal)


async def get_poll_cache(request: Request) -> PollCache:
    cache: PollCache = request.app.state.poll_cache
    return cache


SessionDep = Annotated[Session, Depends(read_session)]
PollCacheDep = Annotated[PollCache, Depends(get_poll_cache)]
WriteSessionDep = Annotated[Session, Depends(write_session)]
DbDep = Annotated[Database, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
PrincipalDep = Annotated[Principal, Depends(current_principal)]
JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="A job id.")]
SweepId = Annotated[int, Path(ge=1, le=MAX_ID, description="A sweep id.")]
