"""How a supervisor starts one training child and talks to it: the seam between Halfway's
scheduling (claims, leases, history: always the supervisor's) and where the training runs.

- ``LocalLauncher``: on this host. It stages the job's files (``workers.staging``), then
  starts ``python -m workers.entry`` in the job's sandbox (``workers.sandbox``), its records
  over a pipe. The handle does the child's store I/O when the supervisor asks.
- ``RayLauncher``: a Ray actor asking for the job's GPUs and CPUs, so Ray places it on a node
  with room; the actor runs a ``LocalLauncher`` there (so staging, the sandbox, SIGTERM and
  crash isolation hold there too) and relays records and store I/O through actor calls. Ray
  is only imported by this launcher (``pip install 'halfway[ray]'``).

Neither imports TensorFlow.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Protocol

from workers import cpu, entry, sandbox, staging
from workers.protocol import JobError, Message, Started

Trainer = Callable[[dict[str, Any], Connection], None]


class Handle(Protocol):
    """One running training child, as the supervisor sees it."""

    pid: int | None
    # Why the child ended, when the launcher knows better than an exit code (a lost node).
    death: str | None
    # Where it runs, for the job's device report ({"host": ..., "ray_node_id": ...}).
    placement: dict[str, str]

    def poll(self, timeout: float) -> list[Message]:
        """Wait up to ``timeout`` seconds for messages or the child's end; every message
        waiting is returned."""
        ...

    def started(self) -> bool:
        """Placed and staged: the child process exists (or staging failed)."""
        ...

    def alive(self) -> bool: ...

    def finished(self) -> bool:
        """Ended, and every message it sent has been returned by ``poll``."""
        ...

    def stop(self) -> None:
        """Ask for a graceful stop (SIGTERM: drain, checkpoint, exit)."""
        ...

    def kill(self) -> None: ...

    @property
    def exitcode(self) -> int | None: ...

    # The child's store I/O, done here on its behalf; the supervisor calls these only while
    # its lease holds.
    def commit_checkpoint(self, step: int) -> None: ...

    def ship(self) -> None: ...

    def publish(self, names: list[str]) -> None: ...

    def close(self) -> None:
        """Release the child and remove its scratch folder."""
        ...


class Launcher(Protocol):
    # Whether the supervisor's own GPUs run its jobs (so it waits for their memory to be freed).
    uses_local_gpus: bool

    def start(
        self, trainer: Trainer, payload: dict[str, Any], *, name: str, gpus: int
    ) -> Handle: ...


def trainer_name(trainer: Trainer) -> str:
    """``module:function`` of a trainer, for ``workers.entry`` to import in the sandbox."""
    module, qualname = trainer.__module__, trainer.__qualname__
    if module == "__main__" or "." in qualname:
        raise ValueError(f"a trainer must be a module-level function, not {module}:{qualname}")
    return f"{module}:{qualname}"


class LocalHandle:
    """A child on this host: staged and started on a thread of its own (a large download
    must not hold up the supervisor's lease renewals), then a process in its sandbox."""

    def __init__(
        self, trainer: Trainer, payload: dict[str, Any], isolation: sandbox.Isolation
    ) -> None:
        self.pid: int | None = None
        self.death: str | None = None
        self.placement = {"host": socket.gethostname()}
        self.isolation = isolation
        self.files: staging.JobFiles | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.receiver: Connection | None = None
        self.pipe_open = True
        self._failure: Message | None = None  # staging failed: this is the only message
        self._pidfd = self._status_fd = self._control = -1
        self._sandbox_pidfd = -1  # the namespace's init, to wait for its end (see kill)
        self._cancelled = False
        self._ready = threading.Event()
        self._staged: staging.Staged | None = None
        self._trainer, self._payload = trainer, payload
        threading.Thread(target=self._start, name="halfway-stage", daemon=True).start()

    # Starting -------------------------------------------------------------------------------

    def _start(self) -> None:
        try:
            self._staged = self._stage(self._payload)
        except JobError as exc:
            self._fail(str(exc), retryable=False)
        except Exception as exc:  # the store unreachable, a full disk: perhaps transient
            self._fail(f"could not stage the job's files: {type(exc).__name__}: {exc}", True)
        finally:
            self._ready.set()

    def _stage(self, payload: dict[str, Any]) -> staging.Staged:
        storage = staging.open_payload_storage(payload)
        scratch_root = Path(payload["scratch_dir"])
        self.files = staging.JobFiles.for_attempt(
            storage, payload["job_id"], payload["attempt"], scratch_root
        )
        return staging.stage(
            storage,
            payload["spec"],
            self.files,
            resume_step=payload.get("resume_step"),
            data_cache=scratch_root / "data",
            code_cache=Path(payload["code_dir"]),
        )

    def _fail(self, error: str, retryable: bool) -> None:
        self._failure = {"type": "done", "status": "failed", "error": error, "retryable": retryable}

    def _spawn(self, trainer: Trainer, payload: dict[str, Any], staged: staging.Staged) -> None:
        receiver_fd, sender_fd = os.pipe()
        control_r, self._control = os.pipe()
        isolated = self.isolation.mode == "bubblewrap"
        child = self._child_payload(trainer, payload, staged, isolated)
        child |= {"message_fd": sender_fd, "control_fd": control_r}
        roots = sandbox.code_roots([child["trainer"].partition(":")[0]])
        keras_home = _keras_datasets()
        extra = {"PYTHONPATH": sandbox.python_path(roots)}
        if isolated and keras_home:
            extra["KERAS_HOME"] = str(sandbox.KERAS)
        if not child["gpu_ids"]:
            # Halfway's specs name a policy; another trainer's (the tests' fakes) need not.
            policy = str(payload["spec"].get("precision", {}).get("policy", ""))
            extra |= cpu.tensorflow_env(policy, cpu.CpuPrecision.detect(), os.environ)
        env = sandbox.child_env(
            os.environ, home=Path(child["job_dir"]), gpu_ids=child["gpu_ids"], extra=extra
        )
        argv = [sys.executable, "-m", "workers.entry"]
        pass_fds = [sender_fd, control_r]
        status_r = -1
        if isolated:
            status_r, status_w = os.pipe()
            pass_fds.append(status_w)
            mounts = _mounts(staged, payload["spec"], roots, keras_home)
            argv = sandbox.command(argv, mounts)
            argv[1:1] = ["--json-status-fd", str(status_w)]
        try:
            # Until the child points its output at the log itself, what it prints (an
            # import that fails) goes there too.
            with open(staged.scratch / staging.LOG, "ab") as log:
                self.process = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=log,
                    env=env,
                    cwd=staged.scratch,
                    pass_fds=pass_fds,
                    start_new_session=True,  # the server's Ctrl-C is not the job's
                )
        finally:
            for fd in pass_fds:
                os.close(fd)  # the child holds the only write ends: EOF means it is gone
        self.receiver = Connection(receiver_fd, writable=False)
        self._pidfd = os.pidfd_open(self.process.pid)
        # Kept open to the end: bwrap writes the exit status there last, and a closed
        # pipe would kill it with SIGPIPE.
        self._status_fd = status_r
        self.pid = _sandboxed_pid(status_r) if isolated else self.process.pid
        if isolated and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                self._sandbox_pidfd = os.pidfd_open(self.pid)
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.write(json.dumps(child).encode())
        self.process.stdin.close()

    def _child_payload(
        self, trainer: Trainer, payload: dict[str, Any], staged: staging.Staged, isolated: bool
    ) -> dict[str, Any]:
        """What the child is told: plain data, its folders as it sees them, no credential."""
        code_dir = None if staged.bundle is None else staged.bundle.parent
        return {
            "trainer": trainer_name(trainer),
            "job_id": payload["job_id"],
            "attempt": payload["attempt"],
            "spec": payload["spec"],
            "gpu_ids": payload.get("gpu_ids") or [],
            "flush_seconds": payload.get("flush_seconds", 0.5),
            "resume_step": staged.resume_step,
            "max_parameters": payload.get("max_parameters"),
            # An earlier attempt's choice for policy "auto": the same model is built again.
            "precision_decision": payload.get("precision_decision"),
            "job_dir": str(sandbox.JOB if isolated else staged.scratch),
            "data_dir": str(sandbox.DATA if isolated else staged.data),
            "code_dir": None if code_dir is None else str(sandbox.CODE if isolated else code_dir),
            "isolation_warning": self.isolation.warning,
            # Outside a PID namespace the child checks that its parent is still us.
            "parent_pid": None if isolated else os.getpid(),
        }

    # Watching -------------------------------------------------------------------------------

    def started(self) -> bool:
        return self._ready.is_set() and not self._waiting_to_spawn()

    def _waiting_to_spawn(self) -> bool:
        return self._staged is not None and self.process is None and not self._cancelled

    def _drain(self, out: list[Message]) -> None:
        assert self.receiver is not None
        try:
            while self.receiver.poll():
                out.append(self.receiver.recv())
        except (EOFError, OSError):
            self.pipe_open = False

    def poll(self, timeout: float) -> list[Message]:
        if not self._ready.wait(timeout):
            return []
        if self._staged is not None and self._waiting_to_spawn():
            # Started here, on the thread that polls, not on the staging thread: the child's
            # death-with-parent signal fires when the thread that started it ends.
            try:
                self._spawn(self._trainer, self._payload, self._staged)
            except Exception as exc:
                self._cancelled = True
                self._fail(f"could not start the training process: {exc}", retryable=True)
        if self.receiver is None:  # staging failed (or we were stopped before it ended)
            failure, self._failure = self._failure, None
            self.pipe_open = False
            return [failure] if failure is not None else []
        out: list[Message] = []
        wait([self.receiver, self._pidfd] if self.pipe_open else [self._pidfd], timeout=timeout)
        if self.pipe_open:
            self._drain(out)
        if self.pipe_open and not self.alive():
            # Exited; whatever it sent is still readable, then EOF.
            self._drain(out)
            if self.pipe_open and not self.receiver.poll(0.5):
                self.pipe_open = False
        for message in out:
            if message["type"] == "started":
                self._announce(message)
        return out

    def _announce(self, started: Started) -> None:
        """A code job that ran without the sandbox says so among its warnings. Added here,
        where the mode is known (on a Ray node, the node's), not by the child."""
        warning = self.isolation.warning
        if warning is not None and self._payload["spec"].get("code"):
            device = started["device"]
            device["warnings"] = [*device.get("warnings", []), warning]

    def alive(self) -> bool:
        if not self._ready.is_set() or self._waiting_to_spawn():
            return True
        return self.process is not None and self.process.poll() is None

    def finished(self) -> bool:
        return self._ready.is_set() and not self.alive() and not self.pipe_open

    def stop(self) -> None:
        """A byte on the control pipe, which the child turns into its own SIGTERM."""
        if self._control >= 0 and self.alive():
            with contextlib.suppress(OSError):
                os.write(self._control, entry.STOP)

    def kill(self) -> None:
        self._cancelled = True  # a child not started yet never starts
        if self.pid is not None and self.alive():
            # In a sandbox, ``pid`` is the namespace's init: SIGKILL to it ends every process
            # in the namespace. Outside one, the child leads its own process group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if self.isolation.mode == "bubblewrap":
                    os.kill(self.pid, signal.SIGKILL)
                else:
                    os.killpg(self.pid, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()  # bwrap itself (in "none" mode, the child again)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10)
        if self._sandbox_pidfd >= 0:
            # bwrap's outer process dies at once; the namespace's init lives on until the
            # kernel has ended every process inside, which for a large training process takes
            # a while. The job is over (its GPU memory free) only when that init is gone.
            select.select([self._sandbox_pidfd], [], [], 10)

    @property
    def exitcode(self) -> int | None:
        if self.process is None:
            return None
        code = self.process.poll()
        if code is not None and self.isolation.mode == "bubblewrap" and code > 128:
            return 128 - code  # bwrap reports a child killed by signal N as 128 + N
        return code

    # Store I/O ------------------------------------------------------------------------------

    def commit_checkpoint(self, step: int) -> None:
        assert self.files is not None
        self.files.commit_checkpoint(step)

    def ship(self) -> None:
        if self.files is not None:
            self.files.ship()

    def publish(self, names: list[str]) -> None:
        assert self.files is not None
        self.files.publish(names)

    def close(self) -> None:
        self._ready.wait()
        if self.receiver is not None:
            self.receiver.close()
        if self.process is not None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        for fd in (self._pidfd, self._status_fd, self._control, self._sandbox_pidfd):
            if fd >= 0:
                os.close(fd)
        self._pidfd = self._status_fd = self._control = self._sandbox_pidfd = -1
        if self.files is not None:
            self.files.remove_scratch()


def _sandboxed_pid(status_fd: int, timeout: float = 60.0) -> int | None:
    """The child's pid (on this host) from bwrap's first status line."""
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([status_fd], [], [], timeout)
        if not ready:
            return None
        chunk = os.read(status_fd, 4096)
        if not chunk:
            return None
        line += chunk
    pid = json.loads(line.split(b"\n", 1)[0]).get("child-pid")
    return int(pid) if pid is not None else None


def _mounts(
    staged: staging.Staged, spec: dict[str, Any], roots: tuple[Path, ...], keras: Path | None
) -> sandbox.Mounts:
    """The job's folders in its sandbox: its scratch, and read-only its data, its own bundle
    (never the whole cache) and the host's Keras dataset cache."""
    inputs = [(staged.data, sandbox.DATA)]
    hex_ = staging.bundle_hex(spec)
    if staged.bundle is not None and hex_ is not None:
        inputs.append((staged.bundle, sandbox.CODE / hex_))
    if keras is not None:
        inputs.append((keras, sandbox.KERAS / "datasets"))
    return sandbox.Mounts(staged.scratch, tuple(inputs), roots)


def _keras_datasets() -> Path | None:
    """The worker's Keras dataset cache (read-only to jobs), if it has one."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    folder = Path(home) / "datasets"
    return folder if folder.is_dir() else None


class LocalLauncher:
    uses_local_gpus = True

    def __init__(self, isolation: sandbox.Isolation) -> None:
        self.isolation = isolation

    def start(
        self, trainer: Trainer, payload: dict[str, Any], *, name: str, gpus: int = 0
    ) -> LocalHandle:
        return LocalHandle(trainer, payload, self.isolation)
