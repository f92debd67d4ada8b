"""The worker supervisor: claims jobs, runs each in its own spawned training child, writes the
child's history to the database in batches, keeps the lease alive, enforces cancel and ends
the job. It never imports TensorFlow.

Why a child per job: TensorFlow holds GPU memory until its process exits, the Keras dtype
policy is process-global, and a crash or OOM in TF must not take the supervisor with it.
Why spawn: a forked SQLAlchemy engine or TF runtime can deadlock.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError

from service import history, jobs
from service.db import Database
from service.history import StepRecord
from service.metrics import HISTORY_WRITE_LATENCY
from service.models import utcnow
from service.settings import Settings
from workers import checkpoints, child, gpus
from workers.protocol import Done, Message

log = logging.getLogger("halfway.worker")

Trainer = Callable[[dict[str, Any], Connection], None]
Clock = Callable[[], datetime]

SPAWN = multiprocessing.get_context("spawn")
DB_RETRY_MAX_SECONDS = 5.0
# At most this many flushes in a row commit without waiting for the disk; the next one waits.
RELAXED_FLUSHES = 8


def new_worker_id(slot: str = "0") -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{slot}-{uuid.uuid4().hex[:6]}"


@dataclass
class Outcome:
    """How one attempt ended, as the supervisor saw it."""

    status: str  # succeeded | failed | cancelled | released | retry | lost
    error: str | None = None


@dataclass
class _Run:
    """The mutable state of one running attempt."""

    job_id: int
    attempt: int
    pending: list[StepRecord] = field(default_factory=list)
    updates: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] | None = None
    new_warnings: list[str] = field(default_factory=list)
    new_forensics: list[dict[str, Any]] = field(default_factory=list)
    pid: int | None = None
    truncate_at: int | None = None
    steps_per_second: float | None = None
    done: Done | None = None
    started: bool = False
    cancel_requested: bool = False
    shutting_down: bool = False
    lease_lost: bool = False
    signalled_at: float | None = None
    hang_error: str | None = None
    last_message: float = field(default_factory=time.monotonic)
    last_sync: float = 0.0
    next_db_try: float = 0.0
    db_backoff: float = 0.25
    db_down_since: float | None = None
    # Rows committed without waiting for the disk (see _sync), kept until a commit that waits.
    unsynced: list[StepRecord] = field(default_factory=list)
    relaxed_flushes: int = 0


class Supervisor:
    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        trainer: Trainer = child.run,
        worker_id: str | None = None,
        gpu_ids: list[int] | None = None,
        clock: Clock = utcnow,
        memory_probe: gpus.MemoryProbe = gpus.used_memory_mib,
    ) -> None:
        self.db = db
        self.settings = settings
        self.trainer = trainer
        self.worker_id = worker_id or new_worker_id()
        self.gpu_ids = list(gpu_ids or [])
        self.clock = clock
        self.memory_probe = memory_probe
        self.stop_event = threading.Event()
        self.current_job: int | None = None

    # ---------------------------------------------------------------------------------------
    # The loop

    def run_forever(self) -> None:
        log.info("worker %s started (gpus: %s)", self.worker_id, self.gpu_ids or "none")
        while not self.stop_event.is_set():
            try:
                ran = self.run_once()
            except DBAPIError as exc:
                log.warning("database unavailable while claiming: %s", exc.orig)
                ran = False
            if not ran:
                self.stop_event.wait(self.settings.poll_seconds)
        log.info("worker %s stopped", self.worker_id)

    def stop(self) -> None:
        self.stop_event.set()

    def gpus_free(self) -> bool:
        """Whether this slot's GPUs are free of the previous job's memory: a cancelled or
        killed child's memory is released by the driver, and the next job must not start
        into a half-full device."""
        return gpus.wait_until_free(
            self.gpu_ids,
            threshold_mib=self.settings.gpu_free_mib,
            timeout=self.settings.gpu_free_timeout_seconds,
            probe=self.memory_probe,
        )

    def run_once(self) -> bool:
        """Claim one job and run it to its end. False when the queue had nothing for us."""
        if not self.gpus_free():
            log.warning(
                "GPUs %s still hold memory after the last job; not claiming yet", self.gpu_ids
            )
            return False
        now = self.clock()
        with self.db.write() as session:
            jobs.expire_abandoned(session, now)
            claim = jobs.claim_next(
                session,
                worker_id=self.worker_id,
                now=now,
                lease_seconds=self.settings.lease_seconds,
                gpus_held=len(self.gpu_ids),
                max_running_per_user=self.settings.max_running_per_user,
            )
        if claim is None:
            return False
        self.current_job = claim.job_id
        try:
            outcome = self._run_claim(claim)
        finally:
            self.current_job = None
        log.info(
            "job %s attempt %s: %s %s",
            claim.job_id,
            claim.attempt,
            outcome.status,
            outcome.error or "",
            extra=self._context(claim.job_id, attempt=claim.attempt, status=outcome.status),
        )
        return True

    def _context(self, job_id: int, **more: object) -> dict[str, object]:
        """Fields a JSON log line carries (``--json-logs``), so lines can be filtered by job
        and worker."""
        return {"job_id": job_id, "worker_id": self.worker_id, **more}

    # ---------------------------------------------------------------------------------------
    # One attempt

    def _payload(self, claim: jobs.Claim, gpu_ids: list[int]) -> dict[str, Any]:
        return {
            "job_id": claim.job_id,
            "attempt": claim.attempt,
            "spec": claim.spec,
            "job_dir": str(self.job_dir(claim.job_id)),
            "data_dir": str(self.settings.resolved_data_dir()),
            "gpu_ids": gpu_ids,
            "flush_seconds": self.settings.history_flush_seconds,
            "resume_step": claim.checkpoint_step,
            "max_parameters": self.settings.max_parameters,
        }

    def job_dir(self, job_id: int) -> Path:
        return self.settings.resolved_artifact_dir() / str(job_id)

    def _gpus_for(self, spec: dict[str, Any]) -> list[int]:
        wanted = spec.get("resources", {}).get("gpus", "auto")
        count = (1 if self.gpu_ids else 0) if wanted == "auto" else int(wanted)
        return self.gpu_ids[:count]

    def _run_claim(self, claim: jobs.Claim) -> Outcome:
        run = _Run(job_id=claim.job_id, attempt=claim.attempt)
        gpu_ids = self._gpus_for(claim.spec)
        receiver, sender = SPAWN.Pipe(duplex=False)
        process = SPAWN.Process(
            target=self.trainer,
            args=(self._payload(claim, gpu_ids), sender),
            name=f"halfway-job-{claim.job_id}",
            daemon=True,
        )
        process.start()
        run.pid = process.pid
        log.info(
            "job %s attempt %s: training in process %s",
            claim.job_id,
            claim.attempt,
            process.pid,
            extra=self._context(claim.job_id, attempt=claim.attempt),
        )
        sender.close()  # the child holds the only write end: EOF means it is gone
        pipe_open = True
        try:
            while True:
                wait([receiver, process.sentinel] if pipe_open else [process.sentinel], timeout=0.2)
                if pipe_open:
                    pipe_open = self._drain(receiver, run)
                self._tick(run, process)
                if run.lease_lost:
                    self._kill(process)
                    return Outcome("lost", "another worker holds the job now")
                if not process.is_alive() and not pipe_open:
                    break
                if not process.is_alive() and pipe_open:
                    # Exited; whatever it sent is still readable, then EOF.
                    pipe_open = self._drain(receiver, run)
                    if pipe_open and not receiver.poll(0.5):
                        pipe_open = False
        finally:
            receiver.close()
            process.join(timeout=5)
            if process.is_alive():
                self._kill(process)
        return self._finish(run, process.exitcode)

    def _drain(self, receiver: Connection, run: _Run) -> bool:
        """Read every message waiting in the pipe. False once the child closed it."""
        try:
            while receiver.poll():
                self._handle(run, receiver.recv())
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, run: _Run, msg: Message) -> None:
        run.last_message = time.monotonic()
        if msg["type"] == "steps":
            run.pending.extend(StepRecord(*r) for r in msg["records"])
            if msg["steps_per_second"] is not None:
                run.steps_per_second = msg["steps_per_second"]
        elif msg["type"] == "started":
            run.started = True
            run.truncate_at = msg["start_step"]
            run.pending = [r for r in run.pending if r.step >= msg["start_step"]]
            run.new_warnings += list(msg["device"].get("warnings", []))
            run.updates.update(
                total_steps=msg["total_steps"],
                steps_per_epoch=msg["steps_per_epoch"],
                precision_report=msg["precision_report"],
                device={
                    **msg["device"],
                    "steps_per_execution": msg["steps_per_execution"],
                    "pid": run.pid,
                },
            )
        elif msg["type"] == "metrics":
            run.metrics = run.metrics or {}
            key = "timing" if msg["epoch"] < 0 else "last_epoch"
            run.metrics[key] = (
                msg["metrics"] if msg["epoch"] < 0 else {"epoch": msg["epoch"], **msg["metrics"]}
            )
        elif msg["type"] == "checkpoint":
            run.updates["checkpoint_step"] = msg["step"]
        elif msg["type"] == "warning":
            run.updates["guard_warning"] = msg["message"]
        elif msg["type"] == "forensics":
            run.new_forensics.append(msg["report"])
        elif msg["type"] == "done":
            run.done = msg

    def _tick(self, run: _Run, process: Any) -> None:
        now = time.monotonic()
        s = self.settings
        due = now - run.last_sync >= min(s.history_flush_seconds, s.lease_seconds / 3)
        if due and now >= run.next_db_try:
            self._sync(run)
        if self.stop_event.is_set() and not run.cancel_requested:
            run.shutting_down = True
        wants_stop = run.cancel_requested or run.shutting_down
        if wants_stop and run.signalled_at is None and process.is_alive():
            process.terminate()  # SIGTERM: drain, checkpoint, exit
            run.signalled_at = now
        if (
            run.signalled_at is not None
            and process.is_alive()
            and now - run.signalled_at > s.cancel_grace_seconds
        ):
            self._kill(process)
        limit = s.hang_timeout_seconds if run.started else s.startup_timeout_seconds
        if process.is_alive() and run.signalled_at is None and now - run.last_message > limit:
            run.hang_error = (
                f"no progress from the training process for {limit:.0f} s "
                f"({'during training' if run.started else 'while starting'}); it was killed"
            )
            self._kill(process)

    def _sync(self, run: _Run) -> bool:
        """Write pending history and updates and renew the lease, in one transaction. Returns
        False if the database was unreachable (everything stays pending for the next try)."""
        now = self.clock()
        pending = run.pending
        started = time.perf_counter()
        # A flush that carries only history need not wait for the disk (PostgreSQL's commit
        # fsync costs more than the write itself): if the database crashes before those rows
        # reach the disk they are gone from it, but not from here. They are kept until a
        # commit that waits (every RELAXED_FLUSHES-th, and any carrying more than history:
        # an acknowledged checkpoint, a truncation, the job's end), which makes every earlier
        # commit durable too; a flush that finds the job's last step behind them writes them
        # again.
        relaxed = (
            run.relaxed_flushes < RELAXED_FLUSHES
            and run.truncate_at is None
            and not run.updates
            and run.metrics is None
            and not run.new_warnings
            and not run.new_forensics
        )
        try:
            with self.db.write() as session:
                job = jobs.renew_and_load(
                    session,
                    job_id=run.job_id,
                    worker_id=self.worker_id,
                    now=now,
                    lease_seconds=self.settings.lease_seconds,
                )
                if job is None:
                    run.lease_lost = True
                    return True
                run.cancel_requested = run.cancel_requested or job.cancel_requested
                stored = -1 if job.last_step is None else job.last_step
                lost = [r for r in run.unsynced if r.step > stored]
                if lost:
                    log.warning(
                        "job %s: the database lost %d committed rows (a crash before they "
                        "reached its disk); writing them again",
                        run.job_id,
                        len(lost),
                        extra=self._context(run.job_id),
                    )
                if run.truncate_at is not None:
                    history.truncate_after(session, job, run.truncate_at)
                for key, value in run.updates.items():
                    setattr(job, key, value)
                if run.metrics is not None:
                    job.metrics = {**job.metrics, **run.metrics}
                if run.new_forensics:
                    # A resumed attempt may capture a step again; keep one report per step.
                    seen = {f["step"] for f in job.forensics}
                    job.forensics = [
                        *job.forensics,
                        *(f for f in run.new_forensics if f["step"] not in seen),
                    ]
                if run.new_warnings:
                    job.warnings = [
                        *job.warnings,
                        *(w for w in run.new_warnings if w not in job.warnings),
                    ]
                history.write_steps(
                    session,
                    job,
                    lost + pending,
                    now=now,
                    steps_per_second=run.steps_per_second,
                    durable=not relaxed,
                )
        except DBAPIError as exc:
            if run.db_down_since is None:
                run.db_down_since = time.monotonic()
                log.warning(
                    "job %s: database write failed, keeping %d rows: %s",
                    run.job_id,
                    len(pending),
                    exc.orig,
                    extra=self._context(run.job_id),
                )
            run.next_db_try = time.monotonic() + run.db_backoff
            run.db_backoff = min(run.db_backoff * 2, DB_RETRY_MAX_SECONDS)
            return False
        HISTORY_WRITE_LATENCY.observe(time.perf_counter() - started)
        acknowledged = run.updates.get("checkpoint_step")
        if acknowledged is not None:
            checkpoints.prune(self.job_dir(run.job_id), acknowledged)
        if run.db_down_since is not None:
            log.info(
                "job %s: database back, wrote %d pending rows",
                run.job_id,
                len(pending),
                extra=self._context(run.job_id),
            )
        run.db_down_since = None
        run.db_backoff = 0.25
        run.pending = run.pending[len(pending) :]
        if relaxed:
            run.unsynced += pending  # ``lost`` is a tail of ``unsynced`` already
            run.relaxed_flushes += 1
        else:
            run.unsynced = []
            run.relaxed_flushes = 0
        run.updates = {}
        run.metrics = None
        run.new_warnings = []
        run.new_forensics = []
        run.truncate_at = None
        run.last_sync = time.monotonic()
        return True

    def _kill(self, process: Any) -> None:
        if process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=10)

    # ---------------------------------------------------------------------------------------
    # The end of an attempt

    def _decide(self, run: _Run, exitcode: int | None) -> Outcome:
        done = run.done
        if run.hang_error is not None:
            return Outcome("failed", run.hang_error)
        if done is not None and done["status"] == "succeeded":
            return Outcome("succeeded")
        if run.cancel_requested:
            return Outcome("cancelled")
        if run.shutting_down:
            return Outcome("released")
        if done is not None and done["status"] == "failed":
            return Outcome("retry" if done["retryable"] else "failed", done["error"])
        if done is not None and done["status"] == "cancelled":
            return Outcome("retry", "the training process was stopped by SIGTERM")
        if exitcode is not None and exitcode < 0:
            try:
                name = signal.Signals(-exitcode).name
            except ValueError:
                name = "unknown"
            return Outcome("retry", f"training process killed by signal {-exitcode} ({name})")
        return Outcome("retry", f"training process exited with code {exitcode} without a result")

    def _finish(self, run: _Run, exitcode: int | None) -> Outcome:
        outcome = self._decide(run, exitcode)
        # Keep trying until the database takes the final state: the history we hold is the
        # only copy.
        while True:
            while not self._sync(run):
                time.sleep(max(0.0, run.next_db_try - time.monotonic()))
            if run.lease_lost:
                return Outcome("lost", "another worker holds the job now")
            try:
                return self._record_outcome(run, outcome)
            except DBAPIError as exc:
                log.warning("job %s: could not record the outcome yet: %s", run.job_id, exc.orig)
                time.sleep(1.0)

    def _record_outcome(self, run: _Run, outcome: Outcome) -> Outcome:
        now = self.clock()
        with self.db.write() as session:
            if outcome.status in ("retry", "failed") and outcome.error:
                jobs.record_attempt_error(
                    session, job_id=run.job_id, attempt=run.attempt, error=outcome.error, now=now
                )
            if outcome.status == "retry":
                job = jobs.get_job(session, run.job_id)
                if run.attempt < job.max_attempts:
                    jobs.requeue(session, job_id=run.job_id, worker_id=self.worker_id, now=now)
                    return outcome
                outcome = Outcome(
                    "failed",
                    f"{outcome.error} (attempt {run.attempt} of {job.max_attempts}; giving up)",
                )
            if outcome.status == "released":
                jobs.requeue(
                    session,
                    job_id=run.job_id,
                    worker_id=self.worker_id,
                    now=now,
                    count_attempt=False,
                )
                return outcome
            ok = jobs.finish(
                session,
                job_id=run.job_id,
                worker_id=self.worker_id,
                status=outcome.status,
                now=now,
                error=outcome.error,
            )
            if not ok:
                return Outcome("lost", "the job was no longer ours when it ended")
        checkpoints.remove_all(self.job_dir(run.job_id))
        return outcome
