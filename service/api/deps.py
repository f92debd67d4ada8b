"""FastAPI dependencies: the database, one session per request, and the caller's identity."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.api.pollcache import PollCache
from service.database.db import Database
from service.errors import Unauthorized
from service.people.auth import LOCAL_PRINCIPAL, Principal
from service.people.authcache import AuthCache
from service.settings import Settings

# Ids are INTEGER columns: 32-bit on PostgreSQL. A larger id in a URL is refused by validation
# (422) instead of reaching the database, where it overflows the column type (a 500).
MAX_ID = 2**31 - 1


def decimal_range_pattern(hi: int) -> str:
    """A regex for the decimal numbers 1..hi without leading zeros, so a schema that takes ids
    in text (``job_ids=1,2``) says exactly which ids it takes."""
    digits = str(hi)
    options = [f"[1-9][0-9]{{0,{len(digits) - 2}}}"] if len(digits) > 1 else []
    for i, d in enumerate(digits):
        low = "1" if i == 0 else "0"
        if int(d) > int(low):
            rest = len(digits) - i - 1
            options.append(f"{digits[:i]}[{low}-{int(d) - 1}]" + (f"[0-9]{{{rest}}}" * bool(rest)))
    options.append(digits)
    return "(?:" + "|".join(options) + ")"


ID_PATTERN = decimal_range_pattern(MAX_ID)

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
    _bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)],
) -> Principal:
    """Async: a token this process verified under the current auth generation is checked on
    the event loop (a hash and a dictionary lookup); see service/people/authcache.py."""
    if not request.app.state.auth:
        return LOCAL_PRINCIPAL
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    cache: AuthCache = request.app.state.auth_cache
    client = request.client.host if request.client else "unknown"
    return await cache.principal(token.strip(), client)


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
