"""The Ray launcher: a Ray actor asking for the job's GPUs and CPUs, so Ray places it on a
node with room. The actor (``TrainingHost``) runs a ``LocalLauncher`` on that node, so
staging, the sandbox, SIGTERM and crash isolation hold there as on the supervisor's host,
and relays the child's records and its store I/O through actor calls. Queue, fairness,
leases and history stay the supervisor's. Ray is only imported here, and only when used
(``pip install 'halfway[ray]'``). No TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

from workers import sandbox
from workers.launchers import LocalHandle, LocalLauncher, Trainer
from workers.protocol import Message

# A reply slower than this counts as a lost actor; well inside a lease, which the supervisor
# renews between polls.
RAY_CALL_SECONDS = 15.0
# Store I/O through the actor (a checkpoint's upload) may take longer.
RAY_IO_SECONDS = 300.0


class TrainingHost:
    """The Ray actor: lives on the node Ray chose, stages the job's files and runs the
    training child there, and does its store I/O when the supervisor asks."""

    def __init__(self) -> None:
        self.handle: LocalHandle | None = None

    def start(self, trainer: Trainer, payload: dict[str, Any], name: str) -> dict[str, Any]:
        import ray

        # Ray picked this node's GPUs for us and says which: the child sees only those.
        payload = {**payload, "gpu_ids": [int(g) for g in ray.get_gpu_ids()]}
        # Scratch and the code cache are this node's, never the supervisor's paths (which
        # this node may not have, or may not be allowed to write).
        scratch = node_scratch_dir()
        payload["scratch_dir"] = str(scratch)
        payload["code_dir"] = os.environ.get("HALFWAY_CODE_DIR") or str(scratch / "code")
        isolation = sandbox.resolve(payload.get("isolation", "auto"))
        self.handle = LocalLauncher(isolation).start(trainer, payload, name=name)
        return {"node_id": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}

    def poll(self, timeout: float) -> tuple[list[Message], bool, int | None, int | None, bool]:
        assert self.handle is not None
        messages = self.handle.poll(timeout)
        h = self.handle
        return messages, h.finished(), h.exitcode, h.pid, h.started()

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.stop()

    def kill(self) -> None:
        if self.handle is not None:
            self.handle.kill()

    def commit_checkpoint(self, step: int) -> None:
        assert self.handle is not None
        self.handle.commit_checkpoint(step)

    def ship(self) -> None:
        if self.handle is not None:
            self.handle.ship()

    def publish(self, names: list[str]) -> None:
        assert self.handle is not None
        self.handle.publish(names)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def node_scratch_dir() -> Path:
    """This node's scratch: HALFWAY_SCRATCH_DIR in the node's environment, else a folder in
    its temporary directory."""
    import tempfile

    configured = os.environ.get("HALFWAY_SCRATCH_DIR")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "halfway-scratch"


class RayHandle:
    def __init__(self, actor: Any, started: Any) -> None:
        self.actor = actor
        self._started_ref: Any = started  # resolves once Ray has placed the actor
        self.pid: int | None = None
        self.placement: dict[str, str] = {}
        self.death: str | None = None
        self._finished = False
        self._staged = False
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
                # lease meanwhile and waits; its startup clock starts once we are placed.
                ready, _ = ray.wait([self._started_ref], timeout=timeout)
                if not ready:
                    return []
                try:
                    started = ray.get(self._started_ref)
                except ray.exceptions.RayTaskError as exc:
                    # Placed, but the node could not host the child (bubblewrap required
                    # and missing there): this attempt fails; another may land elsewhere.
                    return self._start_failed(exc)
                self._started_ref = None
                self.placement = {"host": started["host"], "ray_node_id": started["node_id"]}
            messages, finished, code, pid, staged = ray.get(
                self.actor.poll.remote(timeout), timeout=timeout + RAY_CALL_SECONDS
            )
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            self._lost(exc)
            return []
        self._finished, self._exitcode, self.pid, self._staged = finished, code, pid, staged
        return list(messages)

    def _start_failed(self, exc: BaseException) -> list[Message]:
        cause = getattr(exc, "cause", None) or exc
        self._started_ref = None
        self._finished = True
        error = f"the Ray node could not start the training: {type(cause).__name__}: {cause}"
        return [{"type": "done", "status": "failed", "error": error, "retryable": True}]

    def started(self) -> bool:
        return self._started_ref is None and self._staged

    def _placed(self) -> bool:
        """Whether the actor has run ``start`` (a call to an actor Ray has not placed waits
        for the placement: the supervisor must never make one)."""
        import ray

        if self._started_ref is None:
            return True
        ready, _ = ray.wait([self._started_ref], timeout=0)
        return bool(ready)

    def _call(self, method: str, *args: Any, seconds: float = RAY_IO_SECONDS) -> None:
        import ray

        ray.get(getattr(self.actor, method).remote(*args), timeout=seconds)

    def commit_checkpoint(self, step: int) -> None:
        self._call("commit_checkpoint", step)

    def ship(self) -> None:
        # Before the first poll that sees the actor placed, no child has run: nothing to ship.
        if self._started_ref is None:
            self._call("ship")

    def publish(self, names: list[str]) -> None:
        self._call("publish", names)

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

        if self._placed():  # else no child exists: there is nothing to wait for
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
            if self._placed():
                self._call("close", seconds=RAY_CALL_SECONDS)  # its scratch folder
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)


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
