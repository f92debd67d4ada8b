"""Load: N dashboard pollers against a server whose embedded worker is training and writing
history. Prints, for each of --runs loaded windows, poll latency (p50/p99), errors, the
training's steps/s with and without the pollers (quiet, loaded, quiet again, side by side in
one run) and what the polls cost the server process: its CPU under load less its CPU in the
quiet windows around it, where its embedded supervisor alone is busy. Then the spread.

Each poller reads the job (with If-None-Match) and its new history rows (``after_step``
cursor), once per period, from the job's last step when its window opens. A dashboard reads a
run's past once, when it opens (buckets, for a long run); this measures following a run. From
step 0, each window's pollers read their way through the whole history again in 1,000-row
pages (they did until this was found), so each window cost more than the one before it.

The pollers run in ``wrk`` (Debian's package) when it is installed: on a 2-core machine the
load generator shares the CPU with the server and the training, and a Python generator of
200 pollers costs more CPU than the server's answers to it; without wrk they run as Python
asyncio tasks (``--python`` forces that).

With ``--listen`` the dashboards are as the dashboard now is: each listens to the job's
event stream (``listeners.py``) instead of polling the job and its rows, and the windows
start once every stream is open and answering.

    .venv/bin/python benchmarks/load.py                      # SQLite, 200 pollers, 60 s
    .venv/bin/python benchmarks/load.py --database-url postgresql://root@127.0.0.1:5432/test
    .venv/bin/python benchmarks/load.py --listen --jobs 99   # 200 listening dashboards
    .venv/bin/python benchmarks/load.py --listen --jobs 99 --log-panel  # each with its log open

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
import results

HALFWAY = str(Path(sys.executable).parent / "halfway")
LIST_LIMIT = 100  # the dashboard's job list (config.js: jobListLimit)
JOB = {
    "name": "load-benchmark",
    "data": {"samples": 20000, "features": 784, "classes": 10},
    # Never ends during a benchmark (it is cancelled at the end): on a fast machine 1,000
    # epochs ended inside the last quiet window and halved its steps/s.
    "training": {"epochs": 100_000, "batch_size": 128},
}


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    requests: int = 0
    events: int = 0  # received by the listeners (--listen)

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


class Progress:
    """The job's last recorded step and when the flush that wrote it ran, read from the
    database: a window's steps/s is then exact to the flush. Through the API the step lags
    by up to a flush interval and a poll-cache age, which over a 30 s window is a few per
    cent either way, as much as the effect being measured."""

    def __init__(self, url: str) -> None:
        from service.db import Database

        self.db = Database.connect(url)
        self.postgresql = url.startswith("postgresql")

    def read(self, job_id: int) -> tuple[int, float, str]:
        """(last step, its flush time in seconds, status)."""
        from service.models import Job

        with self.db.read() as session:
            job = session.get(Job, job_id)
            assert job is not None
            return job.last_step or 0, job.updated_at.timestamp(), job.status


async def measure_training(progress: Progress, job_id: int, seconds: float) -> float:
    start_step, start, _ = await asyncio.to_thread(progress.read, job_id)
    await asyncio.sleep(seconds)
    step, end, status = await asyncio.to_thread(progress.read, job_id)
    if status != "running":
        sys.exit(f"the training job is {status}, not running: this window's steps/s is void")
    return (step - start_step) / (end - start)


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


async def conditional(conn: Connection, stats: Stats, kind: str, path: str, etag: str) -> str:
    """GET ``path`` with If-None-Match ``etag``; the ETag to send next time."""
    t = time.perf_counter()
    status, headers, _ = await conn.get(path, etag)
    stats.add(kind, time.perf_counter() - t)
    if status == 200:
        return headers.get("etag", "")
    if status != 304:
        stats.errors += 1
    return etag


async def poller(
    base: str,
    token: str,
    job_id: int,
    stats: Stats,
    stop: asyncio.Event,
    period: float,
    list_limit: int,
    after: int,
) -> None:
    host, port = base.removeprefix("http://").split(":")
    conn = Connection(host, int(port), token)
    etag = list_etag = ""
    await asyncio.sleep(period * (hash(asyncio.current_task()) % 1000) / 1000)  # spread starts
    while not stop.is_set():
        began = time.perf_counter()
        try:
            etag = await conditional(conn, stats, "job", f"/v1/jobs/{job_id}", etag)
            if list_limit:
                list_path = f"/v1/jobs?limit={list_limit}"
                list_etag = await conditional(conn, stats, "list", list_path, list_etag)
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
-- Each connection is a dashboard: it reads the job, then its new history rows (and the job
-- list), then waits; with --listen it only reads the list, its stream being elsewhere.
-- wrk keeps one Lua state per thread, so the connections share the cursor and the ETag: each
-- poll asks for the rows after the newest cursor any of them has seen.
local job_path = "/v1/jobs/%(job)d"
local token = "Bearer %(token)s"
local period_ms = %(period_ms)d
local after = %(after)d
local turn = 0
local errors = 0
local etag = ""
local list_etag = ""
local list_limit = %(list_limit)d
local log_offset = ""  -- the open log panel's byte offset (X-Log-Offset); "" before its first read
local plan = {%(plan)s}  -- what each connection asks for, in turn, once per period
local threads = {}

function setup(thread) table.insert(threads, thread) end

function request()
  turn = turn + 1
  local kind = plan[turn %% #plan + 1]
  -- The list is asked for in gzip, as a browser asks; the job and the history pages plain,
  -- so that a response tells which it answers and the cursor can be read.
  if kind == "job" then
    local headers = {["Authorization"] = token}
    if etag ~= "" then headers["If-None-Match"] = etag end
    return wrk.format("GET", job_path, headers)
  elseif kind == "list" then
    local headers = {["Authorization"] = token, ["Accept-Encoding"] = "gzip"}
    if list_etag ~= "" then headers["If-None-Match"] = list_etag end
    return wrk.format("GET", "/v1/jobs?limit=" .. list_limit, headers)
  elseif kind == "log" then
    -- As panels.js: the last 256 KiB first, then only what was appended since.
    local query = log_offset == "" and "tail=262144" or ("offset=" .. log_offset)
    return wrk.format("GET", job_path .. "/logs?" .. query, {["Authorization"] = token})
  end
  return wrk.format("GET", job_path .. "/history?limit=1000&after_step=" .. after,
                    {["Authorization"] = token})
end

function delay()
  -- the plan's requests spread over the period
  return period_ms / #plan
end

function response(status, headers, body)
  if status >= 400 then errors = errors + 1 return end
  if headers["x-log-offset"] ~= nil then log_offset = headers["x-log-offset"] return end
  -- uvicorn sends header names in lower case; a history page's ETag starts with "h
  local tag = headers["etag"]
  if status ~= 200 or tag == nil then return end
  if string.sub(tag, 2, 2) == "h" then
    local cursor = string.match(body, '"next_after_step":(%%-?%%d+)')
    if cursor ~= nil then after = tonumber(cursor) end
  elseif string.sub(body, 1, 2) == "\\31\\139" then  -- gzip: the list
    list_etag = tag
  else
    etag = tag
  end
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


def lowered(args: argparse.Namespace) -> list[str]:
    """The command prefix that runs a load generator below the server and the training."""
    if args.generator_nice == "idle":  # only CPU time nothing else wants (Linux SCHED_IDLE)
        return ["chrt", "--idle", "0"]
    return ["nice", "-n", str(int(args.generator_nice))]


def run_wrk(
    base: str, token: str, job_id: int, args: argparse.Namespace, after: int = -1
) -> dict[str, float]:
    if args.listen:  # the job and its rows come through the streams: only the list is polled
        plan, period = ["list"], args.list_period
    else:
        plan, period = ["job", "history", *(["list"] if args.jobs else [])], args.period
    if args.log_panel:  # panels.js reads an open log panel once per poll_ms, as the list
        plan.append("log")
    script = Path(tempfile.mkdtemp()) / "poll.lua"
    script.write_text(
        WRK_SCRIPT
        % {
            "job": job_id,
            "after": after,
            "token": token,
            "period_ms": int(period * 1000),
            "list_limit": LIST_LIMIT,
            "plan": ", ".join(f'"{kind}"' for kind in plan),
        }
    )
    out = subprocess.run(
        [
            *lowered(args),
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
    return figures_line(out, "WRK ")


def figures_line(out: str, prefix: str) -> dict[str, float]:
    line = next(x for x in out.splitlines() if x.startswith(prefix))
    return {k: float(v) for k, v in (item.split("=") for item in line.split()[1:])}


def _stat(path: Path) -> tuple[str, float]:
    """A process's command name and user + system CPU seconds, from its /proc stat file."""
    head, fields = path.read_text().rsplit(")", 1)
    values = fields.split()
    return head.partition("(")[2], (int(values[11]) + int(values[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), for the server's share."""
    return _stat(Path(f"/proc/{pid}/stat"))[1]


def database_seconds(progress: Progress) -> float:
    """User + system CPU seconds of this machine's PostgreSQL processes: the queries the
    polls cause run there, not in the server process. 0 on SQLite, whose queries run in it."""
    if not progress.postgresql:
        return 0.0
    total = 0.0
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, seconds = _stat(path)
        except OSError:  # the process ended
            continue
        if name == "postgres":
            total += seconds
    return total


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


@dataclass
class Run:
    """One loaded window and the quiet windows on either side of it."""

    before: float  # steps/s
    loaded: float
    after: float
    quiet_cpu: float  # the server's share of a core in the quiet windows (its supervisor)
    loaded_cpu: float
    quiet_db: float  # PostgreSQL's share in the quiet windows (the supervisor's writes)
    loaded_db: float
    generator_cpu: float
    requests: int
    events: int
    errors: int
    latency: dict[str, tuple[float, float]]  # kind -> (p50, p99) in ms

    @property
    def drop(self) -> float:
        return 1 - self.loaded / statistics.mean([self.before, self.after])

    @property
    def poll_cpu(self) -> float:
        """What the polls cost the server: its share under load less its share without,
        and the same of the database's processes."""
        return self.loaded_cpu - self.quiet_cpu + self.loaded_db - self.quiet_db


async def quiet_window(
    progress: Progress, job_id: int, seconds: float, server_pid: int
) -> tuple[float, float, float]:
    """(steps/s, the server's share of a core, the database's) over ``seconds`` without
    pollers."""
    cpu, db, start = cpu_seconds(server_pid), database_seconds(progress), time.perf_counter()
    steps = await measure_training(progress, job_id, seconds)
    elapsed = time.perf_counter() - start
    return (
        steps,
        (cpu_seconds(server_pid) - cpu) / elapsed,
        (database_seconds(progress) - db) / elapsed,
    )


def generator_seconds(children: resource.struct_rusage, own: float) -> float:
    """CPU seconds the load generator used since ``children`` and ``own`` were read."""
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        now.ru_utime
        + now.ru_stime
        - children.ru_utime
        - children.ru_stime
        + time.process_time()
        - own
    )


async def loaded_window(
    args: argparse.Namespace,
    progress: Progress,
    base: str,
    token: str,
    job_id: int,
    server_pid: int,
    use_wrk: bool,
) -> tuple[float, float, float, float, Stats, dict[str, tuple[float, float]]]:
    """(steps/s, the server's share of a core, the database's, the generator's, the poll
    stats, latencies)."""
    stats = Stats()
    server_cpu, db_cpu = cpu_seconds(server_pid), database_seconds(progress)
    children, own = resource.getrusage(resource.RUSAGE_CHILDREN), time.process_time()
    started = time.perf_counter()
    latency: dict[str, tuple[float, float]] = {}
    head = (await asyncio.to_thread(progress.read, job_id))[0]  # where the pollers start
    if use_wrk:
        wrk = asyncio.create_task(asyncio.to_thread(run_wrk, base, token, job_id, args, head))
        loaded = await measure_training(progress, job_id, args.seconds)
        figures = await wrk
        stats.requests = int(figures["requests"])
        stats.errors = int(figures["errors"] + figures["socket_errors"])
        latency["all"] = (figures["p50"], figures["p99"])
    else:
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(
                poller(
                    base,
                    token,
                    job_id,
                    stats,
                    stop,
                    args.period,
                    LIST_LIMIT if args.jobs else 0,
                    head,
                )
            )
            for _ in range(args.pollers)
        ]
        loaded = await measure_training(progress, job_id, args.seconds)
        stop.set()
        await asyncio.gather(*tasks)
        for kind, values in stats.latencies.items():
            latency[kind] = (pct(values, 0.5), pct(values, 0.99))
    elapsed = time.perf_counter() - started
    server_share = (cpu_seconds(server_pid) - server_cpu) / elapsed
    db_share = (database_seconds(progress) - db_cpu) / elapsed
    generator_share = generator_seconds(children, own) / elapsed
    return loaded, server_share, db_share, generator_share, stats, latency


async def listening_window(
    args: argparse.Namespace,
    progress: Progress,
    base: str,
    token: str,
    job_id: int,
    server_pid: int,
) -> tuple[float, float, float, float, Stats, dict[str, tuple[float, float]]]:
    """As ``loaded_window``, for dashboards that listen (listeners.py). The window starts
    once every stream is open and answering: opening is a dashboard's one-off cost."""
    script = Path(__file__).with_name("listeners.py")
    command = [sys.executable, str(script), "--base", base, "--token", token]
    command += ["--job", str(job_id), "--count", str(args.pollers), "--seconds", str(args.seconds)]
    child = await asyncio.create_subprocess_exec(
        *lowered(args), *command, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    if (await child.stdout.readline()).strip() != b"READY":
        sys.exit("the listeners did not start")
    stats = Stats()
    latency: dict[str, tuple[float, float]] = {}
    server_cpu, db_cpu = cpu_seconds(server_pid), database_seconds(progress)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    polls = (
        asyncio.create_task(asyncio.to_thread(run_wrk, base, token, job_id, args))
        if args.jobs or args.log_panel
        else None
    )
    loaded = await measure_training(progress, job_id, args.seconds)
    heard = figures_line((await child.stdout.read()).decode(), "LISTEN ")
    await child.wait()
    stats.events, stats.errors = int(heard["events"]), int(heard["errors"])
    latency["fan-out spread"] = (heard["p50"], heard["p99"])
    if polls is not None:
        figures = await polls
        stats.requests = int(figures["requests"])
        stats.errors += int(figures["errors"] + figures["socket_errors"])
        latency["list and log" if args.log_panel else "list"] = (figures["p50"], figures["p99"])
    # The children reaped since: wrk and the listeners (their whole life, opening included,
    # which is left out: only their CPU since READY counts).
    reaped = generator_seconds(children, time.process_time())
    generator_cpu = reaped - heard["lifetime_cpu"] + heard["cpu"]
    elapsed = time.perf_counter() - started
    return (
        loaded,
        (cpu_seconds(server_pid) - server_cpu) / elapsed,
        (database_seconds(progress) - db_cpu) / elapsed,
        generator_cpu / elapsed,
        stats,
        latency,
    )


def spread(values: list[float], fmt: str) -> str:
    shown = ", ".join(format(v, fmt) for v in values)
    if len(values) < 2:
        return shown
    return f"{shown} (spread {format(max(values) - min(values), fmt)})"


async def run(
    args: argparse.Namespace, base: str, token: str, server_pid: int, progress: Progress
) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    use_wrk = shutil.which("wrk") is not None and not args.python
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=30) as client:
        job = {**JOB, "precision": {"policy": args.policy}}
        job_id = (await client.post("/v1/jobs", json=job)).json()["id"]
        while (await asyncio.to_thread(progress.read, job_id))[0] < 500:
            await asyncio.sleep(0.5)
        for _ in range(args.jobs):  # the list's other rows: jobs cancelled while queued
            other = (await client.post("/v1/jobs", json=job)).json()["id"]
            assert (await client.post(f"/v1/jobs/{other}/cancel")).status_code == 202
        await asyncio.sleep(args.warmup)
        runs: list[Run] = []
        before, before_cpu, before_db = await quiet_window(
            progress, job_id, args.baseline, server_pid
        )
        for _ in range(args.runs):
            loaded, loaded_cpu, loaded_db, generator_cpu, stats, latency = await (
                listening_window(args, progress, base, token, job_id, server_pid)
                if args.listen
                else loaded_window(args, progress, base, token, job_id, server_pid, use_wrk)
            )
            after, after_cpu, after_db = await quiet_window(
                progress, job_id, args.baseline, server_pid
            )
            runs.append(
                Run(
                    before,
                    loaded,
                    after,
                    statistics.mean([before_cpu, after_cpu]),
                    loaded_cpu,
                    statistics.mean([before_db, after_db]),
                    loaded_db,
                    generator_cpu,
                    stats.requests,
                    stats.events,
                    stats.errors,
                    latency,
                )
            )
            before, before_cpu, before_db = after, after_cpu, after_db
        await client.post(f"/v1/jobs/{job_id}/cancel")

    print(f"database: {args.database_url or 'sqlite (temporary file)'}; training: {args.policy}")
    print(
        f"lean poll path: {'off' if args.no_lean else 'on'}; the API's nice: "
        f"{os.environ.get('HALFWAY_API_NICE', '10 (default)')}; "
        f"wrk's nice: {args.generator_nice if use_wrk else '-'}"
    )
    if args.listen:
        listing = f" and reading the job list ({args.jobs + 1} jobs, wrk) every "
        listing += f"{args.list_period:g} s"
        dashboards = (
            f"dashboards: {args.pollers}, each listening to the job's event stream"
            f"{listing if args.jobs else ''}; "
        )
    else:
        dashboards = (
            f"pollers: {args.pollers} ({'wrk' if use_wrk else 'python'}), one job read "
            f"(If-None-Match) + one after_step read"
            f"{f' + one job list read ({args.jobs + 1} jobs)' if args.jobs else ''}"
            f" every {args.period:g} s each; "
        )
    if args.log_panel:
        dashboards += "each with the job's log panel open (tail, then X-Log-Offset reads); "
    print(
        f"{dashboards}{args.runs} loaded windows of {args.seconds:g} s, each between quiet "
        f"windows of {args.baseline:g} s; {os.cpu_count()} cores"
    )
    for i, r in enumerate(runs, 1):
        latencies = "  ".join(
            f"{kind} p50 {p50:.1f} ms p99 {p99:.1f} ms" for kind, (p50, p99) in r.latency.items()
        )
        heard = f"{r.events / args.seconds:.0f} events/s, " if args.listen else ""
        print(
            f"run {i}: {heard}{r.requests / args.seconds:.0f} requests/s, {r.errors} errors, "
            f"{latencies}"
        )
        print(
            f"  training steps/s: before {r.before:.1f}, under load {r.loaded:.1f}, "
            f"after {r.after:.1f}: {r.drop:.1%} slower"
        )
        print(
            f"  server process (API + embedded supervisor): {r.loaded_cpu:.1%} of a core "
            f"polled, {r.quiet_cpu:.1%} quiet; PostgreSQL's processes {r.loaded_db:.1%} "
            f"polled, {r.quiet_db:.1%} quiet; so the polls cost {r.poll_cpu:.1%}; "
            f"the load generator {r.generator_cpu:.1%}"
        )
    drops = [r.drop * 100 for r in runs]
    costs = [r.poll_cpu * 100 for r in runs]
    errors = sum(r.errors for r in runs)
    print(f"training slower under load (%): {spread(drops, '.1f')}  (target <= 5)")
    print(f"polls' cost on the server (% of a core): {spread(costs, '.1f')}  (target <= 8)")
    met = max(drops) <= 5 and max(costs) <= 8 and errors == 0
    print(f"errors: {errors}; targets {'met' if met else 'NOT met'} in every run")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--pollers", type=int, default=200)
    parser.add_argument(
        "--policy",
        default="float32",
        help="The training job's precision policy. float32 by default: on a CPU with float16 "
        "instructions TensorFlow's float16 kernels ran this model many times slower, "
        "and a job that writes a few steps a second leaves the polls nothing to follow.",
    )
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--baseline", type=float, default=30)
    parser.add_argument("--warmup", type=float, default=5)
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=2, help="Loaded windows (spread shown).")
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="Jobs in the list beside the training one. With N > 0 each poller also reads "
        f"the job list (limit={LIST_LIMIT}, If-None-Match) every period, as the dashboard does "
        "on each refresh; 0: only the job and its history, the issue's two polls.",
    )
    parser.add_argument("--python", action="store_true", help="Python pollers even with wrk.")
    parser.add_argument(
        "--listen",
        action="store_true",
        help="Dashboards as the dashboard now is: each listens to the job's event stream "
        "(listeners.py) instead of polling the job and its rows; with --jobs N each also "
        "reads the job list every --list-period.",
    )
    parser.add_argument(
        "--list-period",
        type=float,
        default=2.0,
        help="With --listen --jobs: seconds between a dashboard's list reads (config.js: poll_ms).",
    )
    parser.add_argument(
        "--generator-nice",
        default="idle",
        help="wrk's nice value, or 'idle' (the default: Linux's SCHED_IDLE, CPU time no one "
        "else wants). The dashboards stand for browsers on other machines, so they should not "
        "take CPU from the server or the training; their latencies then include waits for a "
        "free core.",
    )
    parser.add_argument(
        "--no-lean", action="store_true", help="Every poll through FastAPI's routes (to compare)."
    )
    parser.add_argument(
        "--log-panel",
        action="store_true",
        help="Every dashboard also has the job's log panel open: it reads the log's tail once, "
        "then what was appended (X-Log-Offset), each poll period (panels.js). Needs wrk.",
    )
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="halfway-load-"))
    url = args.database_url or f"sqlite:///{home / 'halfway.db'}"
    wipe(url)
    token = make_token(url)
    port = free_port()
    env = {**os.environ, "HALFWAY_HOME": str(home), "HALFWAY_DATABASE_URL": url}
    env["HALFWAY_LEAN_POLLS"] = "false" if args.no_lean else "true"
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
        asyncio.run(run(args, base, token, server.pid, Progress(url)))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    results.run(main)
