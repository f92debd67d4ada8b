"""Two worker processes on one database, one of them on a host whose clock is ten minutes
off (ahead or behind). Leases are written and compared on the database's clock, so the
skewed worker neither steals a live lease (clock ahead: every lease looks expired to it) nor
writes leases that others see as already expired (clock behind). Real processes, both
databases. The skew is the whole process's: every wall-clock read in it, Python's or a C
library's, is shifted (tests/clockshift.c, built here with gcc and loaded by LD_PRELOAD), so
any code that compares a lease with the host's clock fails this test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, make_url, select, text

from service.database.db import Database, normalize_url
from service.database.models import Job, Step, utcnow
from service.scheduling import jobs
from service.settings import Settings
from tests.conftest import TABLES
from tests.test_supervisor import load, make_job

ROOT = Path(__file__).resolve().parent.parent
SKEW = 600.0


class Workers:
    def __init__(self, settings: Settings, log: Path, shift: Path) -> None:
        self.settings, self.log, self.shift = settings, log, shift
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, worker_id: str, skew: float) -> None:
        shifted = {"LD_PRELOAD": str(self.shift), "HALFWAY_CLOCK_SKEW": str(int(skew))}
        env = {
            **(shifted if skew else {}),
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "HALFWAY_HOME": str(self.settings.home),
            "HALFWAY_DATABASE_URL": self.settings.resolved_database_url(),
            "HALFWAY_LEASE_SECONDS": "30",
            "HALFWAY_POLL_SECONDS": "0.05",
            "HALFWAY_HISTORY_FLUSH_SECONDS": "0.1",
        }
        self.processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.skewed_worker", worker_id],
                env=env,
                stdout=self.log.open("ab"),
                stderr=subprocess.STDOUT,
            )
        )

    def stop(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def db_url(pg_database: str) -> str:
    """PostgreSQL only. A skew is between hosts, and hosts share a database only on
    PostgreSQL: SQLite's clock is the host's (service/database/dbclock.py), read in each process, so
    a process whose clock is shifted shifts its SQLite clock along with it."""
    engine = create_engine(normalize_url(pg_database))
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    engine.dispose()
    return pg_database


@pytest.fixture(scope="module")
def clock_shift(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/clockshift.c built into a shared library to preload."""
    out = tmp_path_factory.mktemp("clockshift") / "clockshift.so"
    source = ROOT / "tests" / "clockshift.c"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", out, source, "-ldl"], check=True)
    return out


@pytest.fixture
def workers(settings: Settings, tmp_path: Path, clock_shift: Path) -> Iterator[Workers]:
    pool = Workers(settings, tmp_path / "workers.log", clock_shift)
    yield pool
    pool.stop()


def wall_clocks(log: Path) -> list[float]:
    """The wall clocks the workers printed on start, in order."""
    return [
        float(line.split()[-1])
        for line in log.read_text().splitlines()
        if line.startswith("wall clock: ")
    ]


@pytest.mark.parametrize("skew", [SKEW, -SKEW], ids=["ahead", "behind"])
def test_the_skewed_process_sees_its_clock_off_and_the_database_does_not(
    settings: Settings, tmp_path: Path, clock_shift: Path, skew: float
) -> None:
    """The shift reaches the whole process: Python's clock and a C library's (libpq's
    connection, asked for the database's now(), is unaffected)."""
    env = {**os.environ, "LD_PRELOAD": str(clock_shift), "HALFWAY_CLOCK_SKEW": str(int(skew))}
    script = (
        "import time, datetime, psycopg, sys;"
        "c = psycopg.connect(sys.argv[1]);"
        "print(time.time(), datetime.datetime.now(datetime.UTC).timestamp(),"
        " c.execute('SELECT now()').fetchone()[0].timestamp())"
    )
    parsed = make_url(normalize_url(settings.resolved_database_url()))
    url = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", script, url], env=env, capture_output=True, text=True, check=True
    )
    after = time.time()
    python_clock, datetime_clock, database_clock = map(float, out.stdout.split())
    for shifted in (python_clock, datetime_clock):
        assert before + skew - 1 <= shifted <= after + skew + 1
    assert before - 5 <= database_clock <= after + 5


def wait_for(predicate: Any, what: str, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


@pytest.mark.parametrize("skew", [SKEW, -SKEW], ids=["ahead", "behind"])
def test_a_worker_whose_clock_is_ten_minutes_off_neither_steals_nor_loses_a_lease(
    db: Database, workers: Workers, skew: float
) -> None:
    # Ahead: the skewed worker comes second and might steal. Behind: it holds the job and
    # its lease might look expired to the honest worker that comes second.
    holder, latecomer = ("honest", "skewed") if skew > 0 else ("skewed", "honest")
    held = make_job(db, {"mode": "slow", "steps": 100_000, "interval": 0.01})
    started = time.time()
    workers.start(holder, 0.0 if holder == "honest" else skew)
    wait_for(lambda: load(db, held).last_step is not None, "the first job to train", workers.log)
    assert load(db, held).worker_id == holder
    # The latecomer's first claim sees both jobs; `held` is the older, so a lease it took for
    # expired would be taken first.
    other = make_job(db, {"mode": "succeed", "steps": 20})
    workers.start(latecomer, 0.0 if latecomer == "honest" else skew)
    wait_for(lambda: load(db, other).status == "succeeded", "the second job", workers.log)
    assert load(db, other).worker_id == latecomer
    # Each worker saw its own clock: the skewed one off by the skew, the honest one not.
    clocks = dict(zip((holder, latecomer), wall_clocks(workers.log), strict=True))
    assert abs(clocks["skewed"] - started - skew) < 60 and abs(clocks["honest"] - started) < 60

    # The held job kept its one owner and attempt while the latecomer was claiming; a few
    # more renewals show the holder still has it.
    job = load(db, held)
    assert (job.status, job.worker_id, job.attempt, job.attempt_errors) == (
        "running",
        holder,
        1,
        [],
    )
    renewed = job.updated_at
    wait_for(lambda: load(db, held).updated_at > renewed, "another renewal", workers.log)
    with db.write() as s:
        jobs.request_cancel(s, held, utcnow())
    wait_for(lambda: load(db, held).status == "cancelled", "the cancel", workers.log)
    job = load(db, held)
    assert (job.worker_id, job.attempt, job.attempt_errors) == (holder, 1, [])
    with db.read() as s:
        steps = list(s.scalars(select(Step.step).where(Step.job_id == held).order_by(Step.step)))
    assert steps == list(range(len(steps))) and job.last_step == len(steps) - 1
    # Times on the job come from one clock: the lease, the start and the end agree.
    assert job.started_at is not None and job.finished_at is not None
    assert job.finished_at >= job.started_at
    with db.read() as s:
        assert s.scalar(select(Job.lease_expires_at).where(Job.id == held)) is None
