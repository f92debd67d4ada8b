"""Load: N dashboard pollers against a server whose embedded worker is training and writing
history. Prints poll latency (p50/p99), errors, and the training's steps/s with and without the
pollers, measured side by side in one run (baseline, load, baseline again).

    .venv/bin/python benchmarks/load.py                      # SQLite, 200 pollers, 60 s
    .venv/bin/python benchmarks/load.py --database-url postgresql://root@127.0.0.1:5432/test

The database named by --database-url is wiped (its tables dropped and recreated).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HALFWAY = str(Path(sys.executable).parent / "halfway")
JOB = {
    "name": "load-benchmark",
    "data": {"samples": 20000, "features": 784, "classes": 10},
    "training": {"epochs": 1000, "batch_size": 128},
}


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    requests: int = 0

    def add(self, kind: str, seconds: float) -> None:
        self.latencies.setdefault(kind, []).append(seconds)
        self.requests += 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wipe(url: str) -> None:
    if url.startswith("sqlite"):
        return
    from sqlalchemy import create_engine, text

    from service.db import normalize_url

    engine = create_engine(normalize_url(url))
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    engine.dispose()


def make_token(url: str) -> str:
    from service import auth, migrate
    from service.db import Database

    db = Database.connect(url)
    migrate.upgrade(db.engine)
    with db.write() as s:
        token = auth.add_user(s, "bench", admin=True)
    db.dispose()
    return token


async def steps_done(client: httpx.AsyncClient, job_id: int) -> int:
    job = (await client.get(f"/v1/jobs/{job_id}")).json()
    return int(job["progress"]["step"] or 0)


async def measure_training(client: httpx.AsyncClient, job_id: int, seconds: float) -> float:
    start_steps, start = await steps_done(client, job_id), time.perf_counter()
    await asyncio.sleep(seconds)
    return (await steps_done(client, job_id) - start_steps) / (time.perf_counter() - start)


async def poller(
    client: httpx.AsyncClient, job_id: int, stats: Stats, stop: asyncio.Event, period: float
) -> None:
    etag = ""
    after = -1
    await asyncio.sleep(period * (hash(asyncio.current_task()) % 1000) / 1000)  # spread starts
    while not stop.is_set():
        began = time.perf_counter()
        try:
            t = time.perf_counter()
            r = await client.get(f"/v1/jobs/{job_id}", headers={"If-None-Match": etag})
            stats.add("job", time.perf_counter() - t)
            if r.status_code == 200:
                etag = r.headers.get("etag", "")
            elif r.status_code != 304:
                stats.errors += 1
            t = time.perf_counter()
            r = await client.get(
                f"/v1/jobs/{job_id}/history", params={"after_step": after, "limit": 1000}
            )
            stats.add("history", time.perf_counter() - t)
            if r.status_code == 200:
                after = r.json()["next_after_step"]
            else:
                stats.errors += 1
        except httpx.HTTPError:
            stats.errors += 1
        await asyncio.sleep(max(0.0, period - (time.perf_counter() - began)))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run(args: argparse.Namespace, base: str, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(
        max_connections=args.pollers + 10, max_keepalive_connections=args.pollers + 10
    )
    async with httpx.AsyncClient(
        base_url=base, headers=headers, limits=limits, timeout=30
    ) as client:
        job_id = (await client.post("/v1/jobs", json=JOB)).json()["id"]
        while (await client.get(f"/v1/jobs/{job_id}")).json()["status"] != "running" or (
            await steps_done(client, job_id)
        ) < 500:
            await asyncio.sleep(0.5)
        await asyncio.sleep(args.warmup)
        before = await measure_training(client, job_id, args.baseline)
        stats = Stats()
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(poller(client, job_id, stats, stop, args.period))
            for _ in range(args.pollers)
        ]
        loaded = await measure_training(client, job_id, args.seconds)
        stop.set()
        await asyncio.gather(*tasks)
        after = await measure_training(client, job_id, args.baseline)
        await client.post(f"/v1/jobs/{job_id}/cancel")

    baseline = statistics.mean([before, after])
    drop = 1 - loaded / baseline
    print(f"database: {args.database_url or 'sqlite (temporary file)'}")
    print(
        f"pollers: {args.pollers}, one job read + one after_step read every {args.period:g} s each"
    )
    print(
        f"requests: {stats.requests} in {args.seconds:g} s "
        f"({stats.requests / args.seconds:.0f}/s), errors: {stats.errors}"
    )
    for kind, values in stats.latencies.items():
        print(
            f"  {kind:8s} p50 {pct(values, 0.5):7.1f} ms   p99 {pct(values, 0.99):7.1f} ms"
            f"   n={len(values)}"
        )
    print(f"training steps/s: before {before:.1f}, under load {loaded:.1f}, after {after:.1f}")
    verdict = "met" if drop < 0.05 and stats.errors == 0 else "NOT met"
    print(f"steps/s drop under load: {drop:.1%} (target < 5% and zero errors: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--pollers", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--baseline", type=float, default=30)
    parser.add_argument("--warmup", type=float, default=5)
    parser.add_argument("--period", type=float, default=1.0)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="halfway-load-"))
    url = args.database_url or f"sqlite:///{home / 'halfway.db'}"
    wipe(url)
    token = make_token(url)
    port = free_port()
    env = {**os.environ, "HALFWAY_HOME": str(home), "HALFWAY_DATABASE_URL": url}
    server = subprocess.Popen(
        [HALFWAY, "serve", "--port", str(port)],
        env=env,
        stdout=(home / "serve.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        asyncio.run(run(args, base, token))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
