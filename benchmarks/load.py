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
from dataclasses import dataclass
from pathlib import Path

import httpx
import results
from pollers import LIST_LIMIT, Stats, figures_line, lowered, poller, run_wrk

HALFWAY = str(Path(sys.executable).parent / "halfway")
JOB = {
    "name": "load-benchmark",
    "data": {"samples": 20000, "features": 784, "classes": 10},
    # Never ends during a benchmark (it is cancelled at the end): on a fast machine 1,000
    # epochs ended inside the last quiet window and halved its steps/s.
    "training": {"epochs": 100_000, "batch_size": 128},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wipe(url: str) -> None:
    if url.startswith("sqlite"):
        return
    from sqlalchemy import create_engine, text

    from service.database.db import normalize_url

    engine = create_engine(normalize_url(url))
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
    engine.dispose()


def make_token(url: str) -> str:
    from service.database import migrate
    from service.database.db import Database
    from service.people import auth

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
        from service.database.db import Database

        self.db = Database.connect(url)
        self.postgresql = url.startswith("postgresql")

    def read(self, job_id: int) -> tuple[int, float, str]:
        """(last step, its flush time in seconds, status)."""
        from service.database.models import Job

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


@dataclass(frozen=True)
class Bench:
    """What a window measures: the options, the database's progress reader, the server (its
    URL, a token and its pid) and the job training meanwhile."""

    args: argparse.Namespace
    progress: Progress
    base: str
    token: str
    job_id: int
    server_pid: int


# (steps/s, the server's share of a core, the database's, the generator's, the poll stats,
# latencies)
Window = tuple[float, float, float, float, Stats, dict[str, tuple[float, float]]]


async def loaded_window(bench: Bench, use_wrk: bool) -> Window:
    """A window with pollers (or wrk) on the job and, with --jobs, on the list."""
    args, progress, base, token = bench.args, bench.progress, bench.base, bench.token
    job_id, server_pid = bench.job_id, bench.server_pid
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


async def listening_window(bench: Bench) -> Window:
    """As ``loaded_window``, for dashboards that listen (listeners.py). The window starts
    once every stream is open and answering: opening is a dashboard's one-off cost."""
    args, progress, base, token = bench.args, bench.progress, bench.base, bench.token
    job_id, server_pid = bench.job_id, bench.server_pid
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
        bench = Bench(args, progress, base, token, job_id, server_pid)
        for _ in range(args.runs):
            loaded, loaded_cpu, loaded_db, generator_cpu, stats, latency = await (
                listening_window(bench) if args.listen else loaded_window(bench, use_wrk)
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
