"""Faults with real processes: PostgreSQL restarted while a job trains, the API killed and
restarted while clients submit. Nothing acknowledged is lost; nothing is duplicated."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from service.database.db import Database
from service.database.models import Job, Step
from service.people import auth
from service.settings import Settings
from tests import fakes
from tests.conftest import PG_URL
from tests.live import free_port
from tests.test_supervisor import load, make_job
from workers.supervisor import Supervisor

HALFWAY = str(Path(sys.executable).parent / "halfway")


def restart_postgresql() -> None:
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"],
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.mark.skipif(not PG_URL, reason="needs HALFWAY_TEST_DATABASE_URL (CI sets it)")
@pytest.mark.restarts_postgresql
def test_postgresql_restart_while_a_job_trains_loses_and_duplicates_nothing(
    pg_database: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="halfway.worker")
    from sqlalchemy import create_engine, text

    from tests.conftest import TABLES

    engine = create_engine(pg_database.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    engine.dispose()
    db = Database.connect(pg_database)
    settings = Settings(
        home=tmp_path / "home",
        database_url=pg_database,
        poll_seconds=0.05,
        history_flush_seconds=0.1,
    )
    settings.ensure_dirs()
    steps = 800
    job_id = make_job(db, {"mode": "slow", "steps": steps, "interval": 0.01})
    sup = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    thread = threading.Thread(target=sup.run_once)
    thread.start()

    def written() -> int:
        with db.read() as s:
            return int(s.scalar(select(func.count()).where(Step.job_id == job_id)) or 0)

    deadline = time.monotonic() + 60
    while written() < 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    restart_postgresql()  # the supervisor's writes fail for a while; it must keep the rows
    thread.join(timeout=120)
    assert not thread.is_alive()
    job = load(db, job_id)
    assert job.status == "succeeded", job.error
    with db.read() as s:
        got = list(s.scalars(select(Step.step).where(Step.job_id == job_id).order_by(Step.step)))
    assert got == list(range(steps))
    assert job.last_step == steps - 1
    # The outage really hit the writes, and the rows held meanwhile were written afterwards.
    assert "database write failed" in caplog.text
    assert "database back, wrote" in caplog.text
    db.dispose()


@pytest.fixture
def served(db: Database, settings: Settings) -> Iterator[dict[str, Any]]:
    with db.write() as s:
        token = auth.add_user(s, "client")
    port = free_port()
    env = {
        **os.environ,
        "HALFWAY_HOME": str(settings.home),
        "HALFWAY_DATABASE_URL": settings.resolved_database_url(),
    }
    log = (settings.home / "serve.log").open("ab")

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [HALFWAY, "serve", "--port", str(port), "--no-worker"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("server did not start")

    state: dict[str, Any] = {"url": f"http://127.0.0.1:{port}", "token": token, "start": start}
    state["proc"] = start()
    yield state
    state["proc"].kill()
    state["proc"].wait()


def test_api_killed_and_restarted_while_clients_submit_keeps_every_acknowledged_job(
    served: dict[str, Any], db: Database
) -> None:
    acknowledged: list[tuple[str, int]] = []
    per_client = [0, 0, 0, 0]  # answers each client got
    refused = [0]  # requests that met no server: the kill really hit the clients
    lock = threading.Lock()
    stop = threading.Event()
    headers = {"Authorization": f"Bearer {served['token']}"}

    def client(n: int) -> None:
        with httpx.Client(base_url=served["url"], headers=headers, timeout=10) as http:
            while not stop.is_set():
                key = uuid.uuid4().hex
                # A careful client retries the same key until it gets an answer.
                while not stop.is_set():
                    try:
                        r = http.post(
                            "/v1/jobs", json={"name": f"c{n}"}, headers={"Idempotency-Key": key}
                        )
                    except httpx.TransportError:
                        with lock:
                            refused[0] += 1
                        time.sleep(0.05)
                        continue
                    if r.status_code in (200, 201):
                        with lock:
                            acknowledged.append((key, r.json()["id"]))
                            per_client[n] += 1
                        break
                    if r.status_code == 503:
                        time.sleep(0.05)
                        continue
                    raise AssertionError(f"unexpected {r.status_code}: {r.text}")

    def every_client_answered(beyond: list[int]) -> None:
        """Wait until each client has had 10 more answers than ``beyond``."""
        deadline = time.monotonic() + 60
        while any(got < before + 10 for got, before in zip(per_client, beyond, strict=True)):
            assert time.monotonic() < deadline, f"answers per client: {per_client}"
            assert all(t.is_alive() for t in threads), "a client failed"
            time.sleep(0.01)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # Killed while all four clients are sending: each has had answers and keeps going.
    every_client_answered([0, 0, 0, 0])
    served["proc"].send_signal(signal.SIGKILL)
    served["proc"].wait()
    with lock:
        before_kill, at_kill = len(acknowledged), list(per_client)
    served["proc"] = served["start"]()
    # The restarted server answers every client again (their retried keys, then new ones).
    every_client_answered(at_kill)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert refused[0] > 0, "no request met the dead server"
    assert before_kill > 0 and len(acknowledged) > before_kill
    ids = {job_id for _, job_id in acknowledged}
    with db.read() as s:
        stored = {key: job_id for key, job_id in s.execute(select(Job.idempotency_key, Job.id))}
    for key, job_id in acknowledged:
        assert stored.get(key) == job_id  # acknowledged, so it exists, under its own key
    # A retried key never made a second job.
    with db.read() as s:
        dupes = s.execute(
            select(Job.idempotency_key).group_by(Job.idempotency_key).having(func.count() > 1)
        ).all()
    assert dupes == []
    assert len(ids) == len(acknowledged)


@pytest.mark.keras
def test_a_hung_training_child_is_killed_and_its_job_fails_saying_so(
    api: Any, db: Database, settings: Settings
) -> None:
    # Training's limit: tracing and compiling the step, which the child announces, has the
    # start-up limit instead (test_code_jobs.py), so this window holds training alone.
    settings.hang_timeout_seconds = 5
    spec = {
        "data": {"samples": 320, "features": 8, "classes": 2},
        "model": {"input_size": 8, "hidden": [8], "num_classes": 2},
        "training": {"epochs": 5, "batch_size": 32, "steps_per_execution": 2},
        "faults": {"hang_at_step": 6},
    }
    job_id = api.post("/v1/jobs", json=spec).json()["id"]
    Supervisor(db, settings).run_once()
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "failed"
    assert "no progress from the training process for 5 s (during training)" in job["error"]
    assert job["summary"]["last_step"] >= 6  # what it did before hanging is kept
    pid = job["device"]["pid"]
    assert (
        not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    )


@pytest.mark.keras
def test_a_full_disk_fails_the_job_clearly_and_the_worker_lives_on(
    api: Any, db: Database, settings: Settings
) -> None:
    spec = {"training": {"epochs": 1, "batch_size": 64}, "data": {"samples": 640}}
    full = api.post("/v1/jobs", json={**spec, "name": "full"}).json()["id"]
    fine = api.post("/v1/jobs", json={**spec, "name": "fine"}).json()["id"]
    folder = settings.resolved_artifact_dir() / str(full)
    folder.mkdir(parents=True)
    # A 256 KiB filesystem: room for the log, not for the ~1.2 MB model.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], check=True)
    try:
        sup = Supervisor(db, settings)
        assert sup.run_once() and sup.run_once()
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    failed = api.get(f"/v1/jobs/{full}").json()
    assert failed["status"] == "failed" and failed["attempt"] == 1
    assert "no space left writing to" in failed["error"]
    assert "No space left on device" in failed["error"]
    assert api.get(f"/v1/jobs/{fine}").json()["status"] == "succeeded"
