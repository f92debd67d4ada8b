"""What the token check costs a polling dashboard: 304 polls of one job (If-None-Match) through
HTTP against one API process (uvicorn in this process), with the poll cache on as in
production, for --seconds per round, interleaved rounds of two settings:

- ``recheck``: as shipped, the auth generation re-read at most every AUTH_RECHECK_SECONDS;
- ``every-request``: the re-read forced on every request (what "refuse a replaced token at
  once" would cost without the shared generation: a query per poll).

Prints polls/s, median and p99 latency per setting, and the auth queries per second.

    .venv/bin/python benchmarks/auth_polls.py [--database-url postgresql://...] [--seconds 5]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import results
import uvicorn

from service.api.app import create_app
from service.database import migrate
from service.database.db import Database
from service.people import auth, authcache
from service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def poll(url: str, token: str, seconds: float) -> tuple[int, list[float]]:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(headers=headers) as client:
        etag = client.get(url).headers["etag"]
        latencies: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            r = client.get(url, headers={"If-None-Match": etag})
            latencies.append(time.perf_counter() - start)
            assert r.status_code == 304, r.status_code
    return len(latencies), latencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp())
    settings = Settings(home=home, database_url=args.database_url)
    settings.ensure_dirs()
    db = Database.connect(settings.resolved_database_url())
    migrate.upgrade(db.engine)
    with db.write() as session:
        token = auth.add_user(session, f"bench-{time.time_ns()}")
    app = create_app(settings, db)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", log_config=None)
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    job = httpx.post(
        f"{base}/v1/jobs", json={}, headers={"Authorization": f"Bearer {token}"}
    ).json()["id"]
    cache: authcache.AuthCache = app.state.auth_cache
    window = authcache.AUTH_RECHECK_SECONDS
    results: dict[str, list[tuple[int, list[float], int]]] = {"recheck": [], "every-request": []}
    for _ in range(args.rounds):
        for name in results:
            authcache.AUTH_RECHECK_SECONDS = window if name == "recheck" else 0.0
            before = cache.queries
            count, latencies = poll(f"{base}/v1/jobs/{job}", token, args.seconds)
            results[name].append((count, latencies, cache.queries - before))
    authcache.AUTH_RECHECK_SECONDS = window
    server.should_exit = True
    print(f"{db.dialect}, {args.rounds} rounds of {args.seconds:g} s, one sequential client")
    for name, rounds in results.items():
        rates = [count / args.seconds for count, _, _ in rounds]
        every = [x for _, latencies, _ in rounds for x in latencies]
        queries = sum(q for _, _, q in rounds) / (args.rounds * args.seconds)
        cut = statistics.quantiles(every, n=100)
        print(
            f"{name:14} polls/s {min(rates):7.0f}-{max(rates):<7.0f} "
            f"p50 {statistics.median(every) * 1000:5.2f} ms  p99 {cut[98] * 1000:5.2f} ms  "
            f"auth queries/s {queries:7.1f}"
        )


if __name__ == "__main__":
    results.run(main)
