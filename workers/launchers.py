"""How a supervisor starts one training child and talks to it: the seam between Halfway's
scheduling (claims, leases, history: always the supervisor's) and where the training runs.

- ``LocalLauncher``: a process on this host, started with multiprocessing *spawn*, its
  records over a pipe (the default).
- ``RayLauncher``: a Ray actor asking for the job's GPUs and CPUs, so Ray places it on a node
  with room; the actor starts the very same training child on that node (so SIGTERM, the
  death-with-parent and crash isolation hold there too) and relays its records back through
  actor calls. Ray is only imported by this launcher (``pip install 'halfway[ray]'``).

Neither imports TensorFlow.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

from workers.protocol import Message

Trainer = Callable[[dict[str, Any], Connection], None]

SPAWN = multiprocessing.get_context("spawn")


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

    def close(self) -> None: ...


class Launcher(Protocol):
    # Whether the supervisor's own GPUs run its jobs (so it waits for their memory to be freed).
    uses_local_gpus: bool

    def start(
        self, trainer: Trainer, payload: dict[str, Any], *, name: str, gpus: int
    ) -> Handle: ...


class LocalHandle:
    def __init__(self, process: Any, receiver: Connection) -> None:
        self.process, self.receiver = process, receiver
        self.pid: int | None = process.pid
        self.death: str | None = None
        self.placement = {"host": socket.gethostname()}
        self.pipe_open = True

    def _drain(self, out: list[Message]) -> None:
        try:
            while self.receiver.poll():
                out.append(self.receiver.recv())
        except (EOFError, OSError):
            self.pipe_open = False

    def poll(self, timeout: float) -> list[Message]:
        out: list[Message] = []
        sentinel = self.process.sentinel
        wait([self.receiver, sentinel] if self.pipe_open else [sentinel], timeout=timeout)
        if self.pipe_open:
            self._drain(out)
        if self.pipe_open and not self.process.is_alive():
            # Exited; whatever it sent is still readable, then EOF.
            self._drain(out)
            if self.pipe_open and not self.receiver.poll(0.5):
                self.pipe_open = False
        return out

    def alive(self) -> bool:
        return bool(self.process.is_alive())

    def finished(self) -> bool:
        return not self.process.is_alive() and not self.pipe_open

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()

    def kill(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)

    @property
    def exitcode(self) -> int | None:
        code: int | None = self.process.exitcode
        return code

    def close(self) -> None:
        self.receiver.close()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.kill()


class LocalLauncher:
    uses_local_gpus = True

    def start(
        self, trainer: Trainer, payload: dict[str, Any], *, name: str, gpus: int = 0
    ) -> LocalHandle:
        receiver, sender = SPAWN.Pipe(duplex=False)
        # The child checks that its parent is still this process (the supervisor, or the Ray
        # actor on another node), not that its parent is "not PID 1": as a container's init,
        # the supervisor is PID 1.
        payload = {**payload, "parent_pid": os.getpid()}
        process = SPAWN.Process(target=trainer, args=(payload, sender), name=name, daemon=True)
        process.start()
        sender.close()  # the child holds the only write end: EOF means it is gone
        return LocalHandle(process, receiver)


# ------------------------------------------------------------------------------------------
# Ray


class TrainingHost:
    """The Ray actor: lives on the node Ray chose, runs the training child there."""

    def __init__(self) -> None:
        self.handle: LocalHandle | None = None

    def start(self, trainer: Trainer, payload: dict[str, Any], name: str) -> dict[str, Any]:
        import ray

        # Ray picked this node's GPUs for us and says which: the child sees only those.
        payload = {**payload, "gpu_ids": [int(g) for g in ray.get_gpu_ids()]}
        # Scratch is this node's disk, not the supervisor's.
        payload["scratch_dir"] = os.environ.get("HALFWAY_SCRATCH_DIR", payload["scratch_dir"])
        self.handle = LocalLauncher().start(trainer, payload, name=name)
        return {
            "pid": self.handle.pid,
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
        }

    def poll(self, timeout: float) -> tuple[list[Message], bool, int | None]:
        assert self.handle is not None
        messages = self.handle.poll(timeout)
        return messages, self.handle.finished(), self.handle.exitcode

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.stop()

    def kill(self) -> None:
        if self.handle is not None:
            self.handle.kill()


class RayHandle:
    def __init__(self, actor: Any, started: Any) -> None:
        self.actor = actor
        self._started_ref: Any = started  # resolves once Ray has placed the actor
        self.pid: int | None = None
        self.placement: dict[str, str] = {}
        self.death: str | None = None
        self._finished = False
        self._exitcode: int | None = None

    def _lost(self, exc: BaseException) -> None:
        self.death = (
            f"the Ray actor running the training was lost ({type(exc).__name__}): its node "
            "died or was removed"
        )
        self._finished = True

    def poll(self, timeout: float) -> list[Message]:
        import ray

        if self._finished:
            return []
        try:
            if self._started_ref is not None:
                # Not placed yet (the cluster may have no room): the supervisor keeps its
                # lease meanwhile, and the startup timeout bounds the wait.
                ready, _ = ray.wait([self._started_ref], timeout=timeout)
                if not ready:
                    return []
                started = ray.get(self._started_ref)
                self._started_ref = None
                self.pid = started["pid"]
                self.placement = {"host": started["host"], "ray_node_id": started["node_id"]}
            messages, finished, code = ray.get(
                self.actor.poll.remote(timeout), timeout=timeout + RAY_CALL_SECONDS
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self._lost(exc)
            return []
        self._finished, self._exitcode = finished, code
        return list(messages)

    def alive(self) -> bool:
        return not self._finished

    def finished(self) -> bool:
        return self._finished

    def stop(self) -> None:
        # Not awaited: the actor may still be waiting for placement; kill() follows anyway.
        self.actor.stop.remote()

    def kill(self) -> None:
        """SIGKILL the child where it runs, then end the actor: ``ray.kill`` alone would leave
        the child to PR_SET_PDEATHSIG, which is as sure but not as prompt."""
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            ray.get(self.actor.kill.remote(), timeout=RAY_CALL_SECONDS)
        ray.kill(self.actor, no_restart=True)
        self._finished = True

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


# A reply slower than this counts as a lost actor; well inside a lease, which the supervisor
# renews between polls.
RAY_CALL_SECONDS = 15.0


class RayLauncher:
    """Connects this process to a Ray cluster (``address``: ``auto``, ``ray://...``,
    ``host:port``; None: ``RAY_ADDRESS`` or a Ray of our own on this host)."""

    uses_local_gpus = False

    def __init__(self, address: str | None = None, *, cpus_per_job: float = 1.0) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace="halfway", log_to_driver=False)
        self.cpus_per_job = cpus_per_job
        self._actor: Any = ray.remote(TrainingHost)

    def gpus_per_node(self) -> int:
        """The most GPUs one node has: a job asking for more could never be placed."""
        import ray

        nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
        return max((int(n["Resources"].get("GPU", 0)) for n in nodes if n.get("Alive")), default=0)

    def start(
        self, trainer: Trainer, payload: dict[str, Any], *, name: str, gpus: int = 0
    ) -> RayHandle:
        actor: Any = self._actor.options(
            num_cpus=self.cpus_per_job,
            num_gpus=gpus,
            max_restarts=0,  # a lost attempt is requeued by Halfway, resumed from the store
            name=None,
        ).remote()
        return RayHandle(actor, actor.start.remote(trainer, payload, name))
