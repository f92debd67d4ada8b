"""Load: N dashboard pollers against a server whose embedded worker is training and writing
history. Prints poll latency (p50/p99), errors, and the training's steps/s with and without the
pollers, measured side by side in one run (baseline, load, baseline again).

Each poller reads the job (with If-None-Match) and its new history rows (``after_step``
cursor), once per period. The pollers run in ``wrk`` (Debian's package) when it is installed:
on a 2-core machine the load generator shares the CPU with the server and the training, and
a Python generator of 200 pollers costs more CPU than the server's answers to it; without wrk
they run as Python asyncio tasks (``--python`` forces that).

    .venv/bin/python benchmarks/load.py                      # SQLite, 200 pollers, 60 s
    .venv/bin/python benchmarks/load.py --database-url postgresql://root@127.0.0.1:5432/test

The database named by --database-url is wiped (its tables dropped and recreated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
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


class Connection:
    """One keep-alive HTTP/1.1 connection with just enough parsing for these polls. The
    pollers share this machine's two cores with the server and the training, so they must
    cost little: a general HTTP client costs more per request than the server's cached poll."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self.token = host, port, token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, path: str, etag: str = "") -> tuple[int, dict[str, str], bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        extra = f"If-None-Match: {etag}\r\n" if etag else ""
        self.writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Authorization: Bearer {self.token}\r\n{extra}\r\n".encode()
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = await self.reader.readexactly(length) if length else b""
        return status, headers, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def poller(
    base: str, token: str, job_id: int, stats: Stats, stop: asyncio.Event, period: float
) -> None:
    host, port = base.removeprefix("http://").split(":")
    conn = Connection(host, int(port), token)
    etag = ""
    after = -1
    await asyncio.sleep(period * (hash(asyncio.current_task()) % 1000) / 1000)  # spread starts
    while not stop.is_set():
        began = time.perf_counter()
        try:
            t = time.perf_counter()
            status, headers, _ = await conn.get(f"/v1/jobs/{job_id}", etag)
            stats.add("job", time.perf_counter() - t)
            if status == 200:
                etag = headers.get("etag", "")
            elif status != 304:
                stats.errors += 1
            t = time.perf_counter()
            status, _, body = await conn.get(
                f"/v1/jobs/{job_id}/history?after_step={after}&limit=1000"
            )
            stats.add("history", time.perf_counter() - t)
            if status == 200:
                after = json.loads(body)["next_after_step"]
            else:
                stats.errors += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            stats.errors += 1
            conn.close()
        await asyncio.sleep(max(0.0, period - (time.perf_counter() - began)))
    conn.close()


WRK_SCRIPT = """
-- Each connection is a dashboard: it reads the job, then its new history rows, then waits.
local job_path = "/v1/jobs/%(job)d"
local token = "Bearer %(token)s"
local period_ms = %(period_ms)d
local after = -1
local turn = 0
local errors = 0
local etag = ""
local threads = {}

function setup(thread) table.insert(threads, thread) end

function request()
  turn = turn + 1
  if turn %% 2 == 1 then
    local headers = {["Authorization"] = token}
    if etag ~= "" then headers["If-None-Match"] = etag end
    return wrk.format("GET", job_path, headers)
  end
  return wrk.format("GET", job_path .. "/history?limit=1000&after_step=" .. after,
                    {["Authorization"] = token})
end

function delay()
  -- two requests per poll, half a period apart
  return period_ms / 2
end

function response(status, headers, body)
  if status >= 400 then errors = errors + 1 end
  if status == 200 and headers["ETag"] ~= nil and not string.find(body, "next_after_step") then
    etag = headers["ETag"]
  end
  local cursor = string.match(body, '"next_after_step":(%%-?%%d+)')
  if cursor ~= nil then after = tonumber(cursor) end
end

function done(summary, latency, requests)
  local failed = 0
  for _, t in ipairs(threads) do failed = failed + (t:get("errors") or 0) end
  io.write(string.format("WRK requests=%%d errors=%%d socket_errors=%%d p50=%%.2f p99=%%.2f\\n",
    summary.requests, failed,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
"""


def run_wrk(base: str, token: str, job_id: int, args: argparse.Namespace) -> dict[str, float]:
    script = Path(tempfile.mkdtemp()) / "poll.lua"
    script.write_text(
        WRK_SCRIPT % {"job": job_id, "token": token, "period_ms": int(args.period * 1000)}
    )
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{args.pollers}",
            f"-d{int(args.seconds)}s",
            "--timeout",
            "30s",
            "-s",
            str(script),
            base,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRK "))
    return {k: float(v) for k, v in (item.split("=") for item in line.split()[1:])}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), for the server's share."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def run(args: argparse.Namespace, base: str, token: str, server_pid: int) -> None:
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
        use_wrk = shutil.which("wrk") is not None and not args.python
        server_cpu = cpu_seconds(server_pid)
        children_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        own_cpu = time.process_time()
        if use_wrk:
            wrk = asyncio.create_task(asyncio.to_thread(run_wrk, base, token, job_id, args))
            loaded = await measure_training(client, job_id, args.seconds)
            figures = await wrk
        else:
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(poller(base, token, job_id, stats, stop, args.period))
                for _ in range(args.pollers)
            ]
            loaded = await measure_training(client, job_id, args.seconds)
            stop.set()
            await asyncio.gather(*tasks)
        server_cpu = cpu_seconds(server_pid) - server_cpu
        done_children = resource.getrusage(resource.RUSAGE_CHILDREN)
        generator_cpu = (
            done_children.ru_utime
            + done_children.ru_stime
            - children_cpu.ru_utime
            - children_cpu.ru_stime
            + time.process_time()
            - own_cpu
        )
        after = await measure_training(client, job_id, args.baseline)
        await client.post(f"/v1/jobs/{job_id}/cancel")

    baseline = statistics.mean([before, after])
    drop = 1 - loaded / baseline
    print(f"database: {args.database_url or 'sqlite (temporary file)'}")
    print(
        f"pollers: {args.pollers} ({'wrk' if use_wrk else 'python'}), one job read + one "
        f"after_step read every {args.period:g} s each"
    )
    if use_wrk:
        stats.requests = int(figures["requests"])
        stats.errors = int(figures["errors"] + figures["socket_errors"])
        print(
            f"requests: {stats.requests} in {args.seconds:g} s "
            f"({stats.requests / args.seconds:.0f}/s), errors: {stats.errors}"
        )
        print(f"  latency  p50 {figures['p50']:7.1f} ms   p99 {figures['p99']:7.1f} ms")
    else:
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
    print(
        f"CPU while polled (this machine has {os.cpu_count()} cores): the server process "
        f"(API, embedded supervisor) {server_cpu / args.seconds:.0%} of a core, the load "
        f"generator {generator_cpu / args.seconds:.0%}"
    )
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
    parser.add_argument("--python", action="store_true", help="Python pollers even with wrk.")
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
        asyncio.run(run(args, base, token, server.pid))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
