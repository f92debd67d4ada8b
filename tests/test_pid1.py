"""Halfway as PID 1, as it runs in a container without an init process (`docker run IMAGE
halfway worker`, or Compose without `init: true`): each service's command from
docker-compose.yml runs as the init of its own PID namespace (`unshare --pid --fork`).

PID 1 differs in two ways that matter: a child whose parent is PID 1 cannot take that to mean
its parent died, and PID 1 gets no signal it has no handler for (so `docker stop`'s SIGTERM
must be handled, or the container is SIGKILLed after its grace period)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from service.settings import Settings
from tests.conftest import Api
from tests.live import free_port
from tests.test_training_keras import SMALL, all_history

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def compose_command(service: str) -> list[str]:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command: list[str] = compose["services"][service]["command"]
    assert command[0] == "halfway"
    return [str(BIN / "halfway"), *command[1:]]


def as_pid1(
    command: list[str], settings: Settings, log: Path, **env: str
) -> subprocess.Popen[bytes]:
    """``command`` as PID 1 of a new PID namespace (with its own /proc, so ``ps`` inside and
    ``os.getppid()`` agree)."""
    environment = {
        **os.environ,
        "HALFWAY_HOME": str(settings.home),
        "HALFWAY_DATABASE_URL": settings.resolved_database_url(),
        "HALFWAY_POLL_SECONDS": "0.2",
        "HALFWAY_HISTORY_FLUSH_SECONDS": "0.2",
        **env,
    }
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", *command],
        env=environment,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def inner_pid(wrapper: subprocess.Popen[bytes]) -> int:
    """The pid, seen from here, of the namespace's PID 1 (the child ``unshare`` forked)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found: list[int] = []
        for task in Path(f"/proc/{wrapper.pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError("unshare started no child")


def namespace_pid(pid: int) -> int:
    """The pid a process has inside its own (innermost) PID namespace."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError("no NSpid line")


def wait_until(predicate: Any, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


def stop(wrapper: subprocess.Popen[bytes], pid1: int, log: Path, grace: float) -> float:
    """SIGTERM to the namespace's init, as `docker stop` sends it; seconds until it ended."""
    started = time.monotonic()
    os.kill(pid1, signal.SIGTERM)
    try:
        wrapper.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        wrapper.kill()
        os.kill(pid1, signal.SIGKILL)
        wrapper.wait(timeout=10)
        raise AssertionError(
            f"PID 1 ignored SIGTERM for {grace} s:\n{log.read_text()[-3000:]}"
        ) from None
    return time.monotonic() - started


def embedded_worker_command() -> list[str]:
    """`halfway serve` as a single container runs it: the API with its embedded worker."""
    return [str(BIN / "halfway"), "serve", "--port", str(free_port())]


@pytest.mark.keras
@pytest.mark.parametrize("command", ["worker-cpu", "serve"])
def test_a_worker_that_is_pid_1_trains_a_job_to_succeeded_and_stops_on_sigterm(
    api: Api, settings: Settings, tmp_path: Path, command: str
) -> None:
    job_id = api.post("/v1/jobs", json=SMALL).json()["id"]
    log = tmp_path / "worker.log"
    argv = compose_command(command) if command == "worker-cpu" else embedded_worker_command()
    wrapper = as_pid1(argv, settings, log)
    try:
        pid1 = inner_pid(wrapper)
        assert namespace_pid(pid1) == 1
        wait_until(
            lambda: api.get(f"/v1/jobs/{job_id}").json()["status"] not in ("queued", "running"),
            240,
            "the job to finish",
            log,
        )
        job = api.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded", f"{job['attempt_errors']}\n{log.read_text()[-3000:]}"
        assert job["attempt"] == 1 and job["attempt_errors"] == []
        # Its child trained inside the namespace, under PID 1.
        assert job["device"]["pid"] > 1
        total = job["progress"]["total_steps"]
        assert total > 0 and [r["step"] for r in all_history(api, job_id)] == list(range(total))
        stop(wrapper, pid1, log, grace=30)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait(timeout=10)


def test_the_api_as_pid_1_serves_and_stops_on_sigterm(settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "api.log"
    command = compose_command("api")
    # The compose file binds 0.0.0.0 inside the container; here loopback is enough.
    command[command.index("--host") + 1] = "127.0.0.1"
    wrapper = as_pid1([*command, "--port", str(port)], settings, log)
    try:
        pid1 = inner_pid(wrapper)
        assert namespace_pid(pid1) == 1

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 60, "the API", log)
        stop(wrapper, pid1, log, grace=20)
        assert wrapper.returncode == 0, log.read_text()[-3000:]
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait(timeout=10)
