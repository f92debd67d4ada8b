"""Token checks that cost a poll no query, yet see a replaced token at once in every process.

Each API process caches what a token's digest is (its user, or why it is refused), tagged with
the ``auth_state.generation`` it was read at. Every change to a user bumps that generation
(service/people/auth.py), and a process trusts its cache only while it has read the generation less
than ``AUTH_RECHECK_SECONDS`` before the request arrived: otherwise the request first waits
for one re-read (shared by every request that arrives meanwhile). A command that changes a
user commits, then waits ``AUTH_RECHECK_SECONDS`` before it reports success: by then every
process's next request re-reads the generation, so from the moment the command returns, the
old token is refused everywhere. Clocks need not agree across hosts; only durations count.

Failed checks are limited per client address (``FailureLimiter``): past a burst, a client gets
429 with Retry-After, answered without a query. A digest known to be bad is cached too, so even
within the burst a repeated bad token costs no query.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TypeVar

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from service.database.db import Database
from service.errors import TooManyRequests, Unauthorized
from service.people import auth
from service.people.auth import Principal, Verdict

AUTH_RECHECK_SECONDS = 0.5
# How long after a user change its command waits before it says it is done: the recheck
# window, plus room for a process's re-read that started just inside it to finish.
CHANGE_SETTLE_SECONDS = AUTH_RECHECK_SECONDS + 0.25
MAX_CACHED_TOKENS = 10_000

T = TypeVar("T")


class FailureLimiter:
    """A token bucket of failed authentications per client address: ``burst`` failures at
    once, then ``per_second`` more. Bounded memory: past ``max_clients`` addresses, the ones
    whose bucket has refilled are forgotten (and if all are still limited, everything is)."""

    def __init__(
        self,
        burst: int,
        per_second: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10_000,
    ) -> None:
        self.burst, self.rate, self.clock, self.max_clients = burst, per_second, clock, max_clients
        self._buckets: dict[str, tuple[float, float]] = {}

    def _level(self, client: str, now: float) -> float:
        tokens, at = self._buckets.get(client, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - at) * self.rate)

    def retry_after(self, client: str) -> int | None:
        """Seconds until this client may fail again; None if it may now."""
        level = self._level(client, self.clock())
        if level >= 1:
            return None
        return max(1, math.ceil((1 - level) / self.rate))

    def fail(self, client: str) -> None:
        now = self.clock()
        level = self._level(client, now) - 1
        if client not in self._buckets and len(self._buckets) >= self.max_clients:
            self._prune(now)
        self._buckets[client] = (level, now)

    def _prune(self, now: float) -> None:
        self._buckets = {
            c: (t, at)
            for c, (t, at) in self._buckets.items()
            if min(float(self.burst), t + (now - at) * self.rate) < self.burst
        }
        if len(self._buckets) >= self.max_clients:
            self._buckets.clear()


class AuthCache:
    def __init__(
        self,
        db: Database,
        limiter: FailureLimiter,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db, self.limiter, self.clock = db, limiter, clock
        self.generation = -1
        self.read_started = -math.inf
        self.queries = 0  # database round trips, for tests and benchmarks
        self._tokens: dict[str, tuple[int, Verdict]] = {}
        self._flight: asyncio.Task[None] | None = None

    async def principal(self, token: str, client: str) -> Principal:
        await self.current()
        digest = auth.hash_token(token)
        known = self._tokens.get(digest)
        if known is not None and known[0] == self.generation and isinstance(known[1], Principal):
            return known[1]
        retry = self.limiter.retry_after(client)
        if retry is not None:
            raise TooManyRequests(
                f"too many failed authentications from this address; retry in {retry} s",
                retry_after=retry,
            )
        if known is not None and known[0] == self.generation:
            verdict = known[1]
        else:
            verdict = await self._lookup(digest)
        if isinstance(verdict, Principal):
            return verdict
        self.limiter.fail(client)
        raise Unauthorized(verdict)

    async def current(self) -> None:
        """Return once the auth generation was read no longer than AUTH_RECHECK_SECONDS
        before this call; one read at a time, shared by every request that waits for it."""
        arrived = self.clock()
        while self.read_started < arrived - AUTH_RECHECK_SECONDS:
            if self._flight is None:
                self._flight = asyncio.ensure_future(self._refresh())
            # Shielded: a client that hangs up must not cancel the read the others await.
            await asyncio.shield(self._flight)

    def known(self, token: str) -> Principal | None:
        """The token's principal if this process verified it under the current generation
        and that generation is still fresh (see ``current``), else None, with nothing counted
        and nothing read: for the lean poll path, which leaves every other case to
        ``principal``."""
        if self.read_started < self.clock() - AUTH_RECHECK_SECONDS:
            return None
        known = self._tokens.get(auth.hash_token(token))
        if known is not None and known[0] == self.generation and isinstance(known[1], Principal):
            return known[1]
        return None

    async def _refresh(self) -> None:
        try:
            started = self.clock()
            generation = await run_in_threadpool(self._read, auth.generation)
            self._observe(generation, started)
        finally:
            self._flight = None

    async def _lookup(self, digest: str) -> Verdict:
        started = self.clock()
        generation, verdict = await run_in_threadpool(
            self._read, lambda session: auth.lookup(session, digest)
        )
        self._observe(generation, started)
        if len(self._tokens) >= MAX_CACHED_TOKENS:
            self._tokens.clear()
        if generation == self.generation:
            self._tokens[digest] = (generation, verdict)
        return verdict

    def _read(self, query: Callable[[Session], T]) -> T:
        self.queries += 1
        with self.db.sessions() as session:
            return query(session)

    def _observe(self, generation: int, started: float) -> None:
        """A read that started at ``started`` saw ``generation``: the cache is good for
        requests that arrive up to AUTH_RECHECK_SECONDS after it started."""
        if generation > self.generation:
            self.generation = generation
            self._tokens.clear()
        self.read_started = max(self.read_started, started)


async def still_valid(request: Request) -> bool:
    """For a long response (the event stream): is the token that opened it still good? A
    stream opened before its token was replaced or its user disabled ends at the next check."""
    if not request.app.state.auth:
        return True
    token = request.headers.get("authorization", "").partition(" ")[2].strip()
    cache: AuthCache = request.app.state.auth_cache
    return await token_still_good(cache, token, request.client.host if request.client else "")


async def token_still_good(cache: AuthCache, token: str, client: str) -> bool:
    """``still_valid`` for a caller that has the token and the client's address at hand."""
    try:
        await cache.principal(token, client or "unknown")
    except (Unauthorized, TooManyRequests):
        return False
    return True


def settle() -> None:
    """Called by a command after it committed a user change: return only once every API
    process refuses what the change took away."""
    time.sleep(CHANGE_SETTLE_SECONDS)
