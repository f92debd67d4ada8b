"""A real API process for tests: `halfway serve --no-worker` on a free port and a given
database, its output kept for the failure message."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import httpx

from tests.conftest import Team
from tests.live import HALFWAY, free_port

__all__ = ["HALFWAY", "ApiProcess"]


class ApiProcess:
    """One `halfway serve --no-worker` on the shared database."""

    def __init__(self, db_url: str, home: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output: list[str] = []
        self.process = subprocess.Popen(
            [HALFWAY, "serve", "--no-worker", "--port", str(self.port)],
            env={
                **os.environ,
                "HALFWAY_HOME": str(home),
                "HALFWAY_DATABASE_URL": db_url,
                **(env or {}),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "".join(self.output)
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError("the API did not start:\n" + "".join(self.output))

    def status(self, token: str) -> int:
        r = httpx.get(f"{self.url}/v1/jobs", headers=Team.header(token), timeout=10)
        return r.status_code

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
