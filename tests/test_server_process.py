"""The README's path, as a newcomer takes it: ``halfway serve`` in its own process (SQLite,
embedded worker, first-start admin token), the example job POSTed over HTTP, one history row
per step, and no TensorFlow in the API process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.live import free_port

ROOT = Path(__file__).resolve().parent.parent
HALFWAY = str(Path(sys.executable).parent / "halfway")


@dataclass
class Server:
    process: subprocess.Popen[str]
    url: str
    token: str
    output: list[str]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def start_server(home: Path, *extra: str, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    process = subprocess.Popen(
        [HALFWAY, "serve", "--port", str(port), *extra],
        cwd=home,
        env={**os.environ, "HALFWAY_HOME": str(home / ".halfway"), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    token_box: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            m = re.search(r"#token=(hw_\S+)", line)
            if m:
                token_box.append(m.group(1))

    threading.Thread(target=pump, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        process.kill()
        raise AssertionError("server did not start:\n" + "".join(output))
    return Server(process, url, token_box[0] if token_box else "", output)


def stop_server(server: Server) -> None:
    server.process.send_signal(signal.SIGINT)
    try:
        server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def threads(pid: int) -> list[int]:
    return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]


def nice_of(pid: int, tid: int) -> int:
    """A thread's nice value, from the kernel (field 19 of its stat)."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = start_server(tmp_path)
    yield s
    stop_server(s)


def test_api_modules_do_not_import_tensorflow() -> None:
    code = (
        "import sys\n"
        "import service.api.app, service.cli, service.scheduling.jobs\n"
        "import service.recording.history, service.specs.normalization\n"
        "import workers.supervisor, workers.child, workers.gpus, workers.protocol\n"
        # The checkpoint format is numpy's: the supervisor prunes without TensorFlow.
        "import workers.checkpoints, workers.checkpointer, workers.context, service.client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_client_command_runs_without_loading_the_database_layer() -> None:
    """`halfway jobs` only talks HTTP: it must not pay for SQLAlchemy, Alembic or the server's
    settings as it starts (they more than doubled every client command's start-up)."""
    code = (
        "import atexit, sys\n"
        "heavy = ('sqlalchemy', 'alembic', 'pydantic_settings', 'fastapi', 'tensorflow')\n"
        "atexit.register(lambda: print(sorted({m.split('.')[0] for m in sys.modules\n"
        "    if m.split('.')[0] in heavy or m.startswith('service.database')})))\n"
        "from service.cli import main\n"
        # Nothing listens on port 9: the command fails to connect, after parsing and running.
        "sys.argv = ['halfway', 'jobs', '--url', 'http://127.0.0.1:9', '--token', 'hw_x']\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "127.0.0.1:9" in result.stderr, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr


@pytest.mark.keras
def test_readme_example_job_finishes_with_one_row_per_step_and_no_tf_in_the_api(
    server: Server,
) -> None:
    assert server.token.startswith("hw_"), "".join(server.output)
    spec = json.loads((ROOT / "examples" / "classic.json").read_text())
    r = httpx.post(f"{server.url}/v1/jobs", json=spec, headers=server.headers)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 300
    job = r.json()
    niceness: dict[str, list[int]] = {}
    while job["status"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.5)
        job = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=server.headers).json()
        trainers = children(server.process.pid)
        if job["status"] == "running" and trainers and not niceness:
            niceness = {
                "api": [nice_of(server.process.pid, server.process.pid)],
                "training": [nice_of(p, t) for p in trainers for t in threads(p)],
            }
    assert job["status"] == "succeeded", job["error"]
    # The API's thread runs below the training (HALFWAY_API_NICE, 10 by default); the training
    # child, and every thread of it, at the priority the server was started with.
    assert niceness["api"] == [10], niceness
    assert niceness["training"] and set(niceness["training"]) == {0}, niceness
    total = job["progress"]["total_steps"]
    assert total == 5 * 313
    rows = []
    after = -1
    while True:
        page = httpx.get(
            f"{server.url}/v1/jobs/{job_id}/history",
            params={"after_step": after, "limit": 10_000},
            headers=server.headers,
        ).json()
        rows += page["items"]
        after = page["next_after_step"]
        if not page["has_more"]:
            break
    assert [row["step"] for row in rows] == list(range(total))
    assert all(row["loss_scale"] >= 1 for row in rows)
    # The API process (which runs the embedded supervisor) never loaded TensorFlow.
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    assert "tensorflow" not in maps and "libtensorflow" not in maps


def test_first_start_prints_an_admin_token_once(tmp_path: Path) -> None:
    first = start_server(tmp_path, "--no-worker")
    stop_server(first)
    assert first.token.startswith("hw_")
    second = start_server(tmp_path, "--no-worker")
    stop_server(second)
    assert second.token == ""  # users exist now: nothing printed
    r_text = "".join(second.output)
    assert "hw_" not in r_text


def test_no_auth_is_refused_off_loopback(tmp_path: Path) -> None:
    result = subprocess.run(
        [HALFWAY, "serve", "--host", "0.0.0.0", "--no-auth", "--no-worker"],
        cwd=tmp_path,
        env={**os.environ, "HALFWAY_HOME": str(tmp_path / ".halfway")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "refusing --no-auth" in result.stderr


def test_no_auth_on_loopback_warns_loudly_and_needs_no_token(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--no-auth", "--no-worker")
    try:
        r = httpx.get(f"{server.url}/v1/jobs")
        assert r.status_code == 200
    finally:
        stop_server(server)
    assert "authentication is OFF" in "".join(server.output)
