"""A live Halfway for tests: the real app under uvicorn on a free port, a real worker, and
the real ``halfway`` executable. Registered as a pytest plugin in conftest.py, so any test can
ask for the ``live`` and ``worker`` fixtures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from service.api.app import create_app
from service.database.db import Database
from service.settings import Settings
from tests.conftest import Team
from workers.supervisor import Supervisor

HALFWAY = str(Path(sys.executable).parent / "halfway")
# Variables that would leak the developer's own client setup into a test.
CLIENT_ENV = ("HALFWAY_URL", "HALFWAY_TOKEN", "HALFWAY_CONFIG", "XDG_CONFIG_HOME", "COLUMNS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Live:
    """A running server and what the tests need to talk to it and look behind it."""

    url: str
    team: Team
    db: Database
    settings: Settings
    home: Path  # $HOME for the CLI: no config file unless a test writes one

    def api(self, method: str, path: str, token: str | None = None, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {token or self.team.admin}"}
        r = httpx.request(method, f"{self.url}{path}", headers=headers, timeout=10, **kw)
        assert r.status_code < 300, r.text
        return r.json()

    def submit(self, spec: dict[str, Any], token: str | None = None) -> int:
        job_id: int = self.api("POST", "/v1/jobs", token or self.team.alice, json=spec)["id"]
        return job_id

    def env(self, **overrides: str | None) -> dict[str, str | None]:
        """The CLI's environment: alice against this server, no config file."""
        base: dict[str, str | None] = {k: None for k in CLIENT_ENV}
        base |= {"HALFWAY_URL": self.url, "HALFWAY_TOKEN": self.team.alice, "HOME": str(self.home)}
        return base | overrides


@pytest.fixture
def live(settings: Settings, db: Database, team: Team, tmp_path: Path) -> Iterator[Live]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings, db, auth=True),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            log_config=None,
        )
    )
    thread = threading.Thread(target=server.run, name="halfway-test-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    home = tmp_path / "client-home"
    home.mkdir()
    yield Live(f"http://127.0.0.1:{port}", team, db, settings, home)
    server.should_exit = True
    thread.join(timeout=20)


@pytest.fixture
def worker(db: Database, settings: Settings) -> Iterator[Supervisor]:
    """A real supervisor: each job trains in a spawned child with TensorFlow on the CPU."""
    supervisor = Supervisor(db, settings)
    thread = threading.Thread(
        target=supervisor.run_forever, name="halfway-test-worker", daemon=True
    )
    thread.start()
    yield supervisor
    supervisor.stop()
    thread.join(timeout=60)


def halfway(
    live: Live | None,
    *args: str,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess[str]:
    """The real ``halfway`` executable in a subprocess."""
    merged = {**os.environ, **{k: None for k in CLIENT_ENV}}
    merged |= (live.env() if live else {}) | dict(env or {})
    clean = {k: v for k, v in merged.items() if v is not None}
    return subprocess.run(
        [HALFWAY, *args], env=clean, capture_output=True, text=True, timeout=timeout
    )
