"""Two `halfway serve` started at the same moment on an empty database (as Compose or a
process manager starts replicas): both migrate, both come up, and the first-start admin is
created once. Real processes, both databases."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from alembic.migration import MigrationContext
from sqlalchemy import func, select

from service.database.db import Database
from service.database.models import User
from tests.live import free_port
from tests.test_migrations import empty_database  # noqa: F401 (a fixture)

HALFWAY = str(Path(sys.executable).parent / "halfway")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("attempt", range(3))
def test_two_servers_started_at_once_on_an_empty_database_both_come_up(
    empty_database: str,  # noqa: F811
    tmp_path: Path,
    attempt: int,
) -> None:
    env = {
        **os.environ,
        "HALFWAY_HOME": str(tmp_path / "home"),
        "HALFWAY_DATABASE_URL": empty_database,
    }
    ports = [free_port(), free_port()]
    logs = [tmp_path / f"serve-{i}.log" for i in range(2)]
    servers = [
        subprocess.Popen(
            [HALFWAY, "serve", "--no-worker", "--port", str(port)],
            env=env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        for port, log in zip(ports, logs, strict=True)
    ]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        deadline = time.monotonic() + 90
        while not all(healthy(u) for u in urls):
            exited = [s.returncode for s in servers if s.poll() is not None]
            if exited or time.monotonic() > deadline:
                output = "\n---\n".join(log.read_text() for log in logs)
                raise AssertionError(f"a server did not come up (exit {exited}):\n{output}")
            time.sleep(0.1)
    finally:
        for s in servers:
            s.send_signal(signal.SIGINT)
        for s in servers:
            try:
                s.wait(timeout=30)
            except subprocess.TimeoutExpired:
                s.kill()
                s.wait()
    tokens = [t for log in logs for t in re.findall(r"#token=(hw_\S+)", log.read_text())]
    assert len(tokens) == 1, tokens
    db = Database.connect(empty_database)
    try:
        with db.engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_heads()
        with db.read() as session:
            assert session.scalar(select(func.count()).select_from(User)) == 1
    finally:
        db.dispose()
