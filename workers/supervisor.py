"""The worker supervisor: claims jobs, runs each in its own spawned training child, writes the
child's history to the database in batches, keeps the lease alive, enforces cancel and ends
the job. It never imports TensorFlow.

Why a child per job: TensorFlow holds GPU memory until its process exits, the Keras dtype
policy is process-global, and a crash or OOM in TF must not take the supervisor with it.
Why spawn: a forked SQLAlchemy engine or TF runtime can deadlock.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from sqlalchemy.exc import DBAPIError

from service.database.db import Database
from service.files.storage import open_storage
from service.people import grants
from service.recording import epochmetrics, gradients
from service.recording.heldflush import HeldAppender
from service.recording.records import StepRecord
from service.scheduling import fairshare, jobs, preemption, slots
from service.settings import Settings
from workers import checkpoints, child, gpus, preempting, sandbox
from workers.attempt import Attempt, Outcome, decide
from workers.context import ARTIFACT_VOLUME, disk_errors_explained
from workers.flush import HistoryWriter
from workers.launchers import Handle, Launcher, LocalLauncher, Trainer
from workers.protocol import JobError, Message
from workers.staging import SHIP_SECONDS, UnsafeOutput

log = logging.getLogger("halfway.worker")


def new_worker_id(slot: str = "0") -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{slot}-{uuid.uuid4().hex[:6]}"


class Supervisor:
    def __init__(
        self,
        db: Database,
        settings: Settings,
        *,
        trainer: Trainer = child.run,
        worker_id: str | None = None,
        gpu_ids: list[int] | None = None,
        memory_probe: gpus.MemoryProbe = gpus.used_memory_mib,
        launcher: Launcher | None = None,
    ) -> None:
        self.db = db
        self.settings = settings
        self.fair = fairshare.Rule.from_settings(settings)  # the claim order and usage
        self.trainer = trainer
        self.worker_id = worker_id or new_worker_id()
        self.gpu_ids = list(gpu_ids or [])
        self.memory_probe = memory_probe
        # The sandbox is made where the child runs: here for the local launcher (a host that
        # cannot make it is announced now, or refused), on each node for Ray's.
        self.isolation: sandbox.Isolation | None = None
        if launcher is None:
            self.isolation = sandbox.resolve(settings.code_isolation)
            if self.isolation.warning is not None:
                log.warning("training children run without isolation: %s", self.isolation.why)
            launcher = LocalLauncher(self.isolation)
        self.launcher: Launcher = launcher
        self.storage = open_storage(settings.storage_config())
        self.stop_event = threading.Event()
        self.current_job: int | None = None
        self.appender = (
            HeldAppender(db.engine, f"halfway-worker {self.worker_id}")
            if db.dialect == "postgresql"
            else None
        )
        self.writer = HistoryWriter(
            db, settings, self.worker_id, self.appender, self.storage.artifacts
        )

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
        self.close()
        log.info("worker %s stopped", self.worker_id)

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        """Withdraw this worker's slot, and close its own database connection (the
        flushes'), if it has one."""
        try:
            with self.db.write() as session:
                slots.withdraw(session, worker_id=self.worker_id)
        except DBAPIError as exc:  # the slot ages out instead (slots.largest)
            log.warning("could not withdraw slot %s: %s", self.worker_id, exc.orig)
        if self.appender is not None:
            self.appender.close()

    def gpus_free(self) -> bool:
        """Whether this slot's GPUs are free of the previous job's memory: a cancelled or
        killed child's memory is released by the driver, and the next job must not start
        into a half-full device. (Under Ray the GPUs are Ray's to hand out.)"""
        if not self.launcher.uses_local_gpus:
            return True
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
        with self.db.write() as session:
            jobs.expire_abandoned(session)
            slots.offer(session, worker_id=self.worker_id, gpus=len(self.gpu_ids))
            claim = jobs.claim_next(
                session,
                worker_id=self.worker_id,
                lease_seconds=self.settings.lease_seconds,
                gpus_held=len(self.gpu_ids),
                rule=self.fair,
            )
        if claim is None:
            return False
        self.current_job = claim.job_id
        try:
            outcome = self._refuse_code_job(claim) or self._run_claim(claim)
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
            "storage": self.settings.storage_config().to_dict(),
            "scratch_dir": str(self.settings.resolved_scratch_dir()),
            "gpu_ids": gpu_ids,
            "flush_seconds": self.settings.history_flush_seconds,
            "resume_step": claim.checkpoint_step,
            "max_parameters": self.settings.max_parameters,
            "code_dir": str(self.settings.resolved_code_dir()),
            "isolation": self.settings.code_isolation,
            # The auto policy's pick of an earlier attempt: this one trains with it and does
            # not probe again, so that a resumed attempt builds the same model.
            "precision_decision": claim.precision_decision,
        }

    def _gpus_for(self, spec: dict[str, Any]) -> list[int]:
        wanted = spec.get("resources", {}).get("gpus", "auto")
        count = (1 if self.gpu_ids else 0) if wanted == "auto" else int(wanted)
        return self.gpu_ids[:count]

    def _run_claim(self, claim: jobs.Claim) -> Outcome:
        run = Attempt(job_id=claim.job_id, attempt=claim.attempt, resume_step=claim.checkpoint_step)
        gpu_ids = self._gpus_for(claim.spec)
        handle = self.launcher.start(
            self.trainer,
            self._payload(claim, gpu_ids),
            name=f"halfway-job-{claim.job_id}",
            gpus=len(gpu_ids),
        )
        run.pid = handle.pid
        log.info(
            "job %s attempt %s: training in process %s",
            claim.job_id,
            claim.attempt,
            handle.pid,
            extra=self._context(claim.job_id, attempt=claim.attempt),
        )
        try:
            while True:
                for msg in handle.poll(0.2):
                    run.pid, run.placement = handle.pid, handle.placement
                    self._handle(run, msg, handle)
                self._tick(run, handle)
                if run.lease_lost:
                    handle.kill()
                    return Outcome("lost", "another worker holds the job now")
                if handle.finished():
                    break
            run.death = handle.death
            stored = self._store_outputs(run, handle)
        finally:
            handle.close()
        return self._finish(run, handle.exitcode, stored)

    def _fenced(self, run: Attempt) -> bool:
        """Whether our lease certainly still holds, so a store write of this attempt's may be
        made: the database set it to expire lease_seconds after a renewal we sent at
        ``renewed_at`` or later (a margin covers the clocks' rates)."""
        held_for = time.monotonic() - run.renewed_at
        return not run.lease_lost and held_for < 0.8 * self.settings.lease_seconds

    def _store_outputs(self, run: Attempt, handle: Handle) -> Outcome | None:
        """The child's last log lines and saved files into the store, while the lease holds.
        If that fails, how the attempt ends instead: failed on a full store (a retry would
        fill it again), else retried (its checkpoint is stored)."""
        if not self._fenced(run):
            self._sync(run)  # renew the lease, or learn it is lost
        if not self._fenced(run):
            return Outcome("retry", "the lease could not be renewed to store the job's outputs")
        store = self.settings.resolved_artifact_dir()
        try:
            with disk_errors_explained(store / str(run.job_id), ARTIFACT_VOLUME):
                handle.ship()
                if run.done is not None and run.done["status"] == "succeeded" and run.saved:
                    handle.publish(run.saved)
        except JobError as exc:
            return Outcome("failed", str(exc))
        except UnsafeOutput as exc:  # a link to a file of the server's, say: never a retry
            return Outcome("failed", f"the job's output was refused: {exc}")
        except Exception as exc:
            return Outcome(
                "retry", f"could not store the job's outputs: {type(exc).__name__}: {exc}"
            )
        return None

    def _commit_checkpoint(self, run: Attempt, handle: Handle, step: int) -> None:
        """Put the child's checkpoint into the store, then have it acknowledged with the next
        flush. Fenced like a history write: the lease is renewed first (with the rows the
        checkpoint covers), and an attempt that has lost its job, or cannot tell, writes
        nothing the attempt holding it now could resume from."""
        self._sync(run)
        if not self._fenced(run):
            log.warning(
                "job %s: not storing the checkpoint of step %s: the lease is not certain",
                run.job_id,
                step,
                extra=self._context(run.job_id),
            )
            return
        try:
            handle.commit_checkpoint(step)
        except Exception as exc:  # the store is down: the next checkpoint tries again
            log.warning(
                "job %s: could not store the checkpoint of step %s: %s",
                run.job_id,
                step,
                exc,
                extra=self._context(run.job_id),
            )
            return
        run.updates["checkpoint_step"] = step

    def _handle(self, run: Attempt, msg: Message, handle: Handle) -> None:
        run.last_message = time.monotonic()
        run.compiling = msg["what"] if msg["type"] == "compiling" else None
        if msg["type"] == "steps":
            run.pending.extend(StepRecord(*r) for r in msg["records"])
            if msg["steps_per_second"] is not None:
                run.steps_per_second = msg["steps_per_second"]
        elif msg["type"] == "started":
            run.started = True
            run.truncate_at = msg["start_step"]
            if run.resume_step is not None and msg["start_step"] != run.resume_step:
                run.missing_checkpoint = (
                    f"attempt {run.attempt}: the acknowledged checkpoint of step "
                    f"{run.resume_step} was missing from the job's store, so the "
                    f"job restarted from step {msg['start_step']} (its history from there on "
                    "is replaced)"
                )
                run.updates["checkpoint_step"] = None
            run.pending = [r for r in run.pending if r.step >= msg["start_step"]]
            run.new_gradients = [g for g in run.new_gradients if g["step"] >= msg["start_step"]]
            run.new_warnings += list(msg["device"].get("warnings", []))
            run.updates.update(
                total_steps=msg["total_steps"],
                steps_per_epoch=msg["steps_per_epoch"],
                precision_report=msg["precision_report"],
                device={
                    **msg["device"],
                    "steps_per_execution": msg["steps_per_execution"],
                    "pid": run.pid,
                    **run.placement,
                },
            )
        elif msg["type"] == "metrics":
            run.metrics = run.metrics or {}
            key = "timing" if msg["epoch"] < 0 else "last_epoch"
            run.metrics[key] = (
                msg["metrics"] if msg["epoch"] < 0 else {"epoch": msg["epoch"], **msg["metrics"]}
            )
            if msg["epoch"] >= 0:  # every epoch's, for the general flush (epoch_metric)
                run.new_epochs.append(epochmetrics.clean_epoch(msg["epoch"], msg["metrics"]))
        elif msg["type"] == "checkpoint":
            self._commit_checkpoint(run, handle, msg["step"])
        elif msg["type"] == "saved":
            run.saved = list(msg["names"])
        elif msg["type"] == "warning":
            run.updates["guard_warning"] = msg["message"]
        elif msg["type"] == "forensics":
            run.new_forensics.append(msg["report"])
        elif msg["type"] == "note":
            run.new_notes.append(msg["message"])
        elif msg["type"] == "gradients":
            self._take_gradients(run, msg["samples"])
        elif msg["type"] == "decision":
            self._take_decision(run, msg["decision"])
        elif msg["type"] == "alarm":
            message = str(msg["message"])
            if message not in run.new_warnings:
                run.new_warnings.append(message)  # and once on the job (the flush)
        elif msg["type"] == "done":
            run.done = msg

    def _take_decision(self, run: Attempt, decision: Any) -> None:
        try:
            run.updates["precision_decision"] = gradients.clean_decision(decision)
        except (TypeError, ValueError, AttributeError) as exc:
            log.warning(
                "job %s: dropped a malformed precision decision: %s",
                run.job_id,
                exc,
                extra=self._context(run.job_id),
            )

    def _take_gradients(self, run: Attempt, samples: list[Any]) -> None:
        """Keep the child's samples for the next general flush, cleaned: the child runs the
        user's code, and a sample that is not one is dropped with a line in the log rather
        than failing the flush that carries it (and every one after it)."""
        for sample in samples if isinstance(samples, list) else [samples]:
            try:
                run.new_gradients.append(gradients.clean_sample(sample))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                log.warning(
                    "job %s: dropped a malformed gradient sample: %s",
                    run.job_id,
                    exc,
                    extra=self._context(run.job_id),
                )
        if run.new_gradients and run.gradients_since is None:
            run.gradients_since = time.monotonic()

    def _tick(self, run: Attempt, process: Handle) -> None:
        now = time.monotonic()
        s = self.settings
        if not process.started():
            # Staging, or waiting for Ray to place the child: the startup clock has not begun.
            run.last_message = now
        if now - run.shipped_at >= SHIP_SECONDS and self._fenced(run):
            run.shipped_at = now
            try:
                process.ship()
            except Exception as exc:  # the store is down: the next round tries again
                log.warning("job %s: shipping the log failed: %s", run.job_id, exc)
        due = now - run.last_sync >= min(s.history_flush_seconds, s.lease_seconds / 3)
        if due and now >= run.next_db_try and self._sync(run):
            run.shutting_down |= preempting.look(self.db, s, self.worker_id, run)
        if self.stop_event.is_set() and not run.cancel_requested:
            run.shutting_down = True
        wants_stop = run.cancel_requested or run.shutting_down
        if wants_stop and run.signalled_at is None and process.alive():
            process.stop()  # SIGTERM: drain, checkpoint, exit
            run.signalled_at = now
        if (
            run.signalled_at is not None
            and process.alive()
            and now - run.signalled_at > s.cancel_grace_seconds
        ):
            process.kill()
        # Tracing and compiling a step function is starting up, however long a big model's
        # compile takes: the child says so first, and training's limit applies again from
        # its next message.
        if not run.started:
            limit, phase = s.startup_timeout_seconds, "while starting"
        elif run.compiling is not None:
            limit, phase = s.startup_timeout_seconds, f"while compiling {run.compiling}"
        else:
            limit, phase = s.hang_timeout_seconds, "during training"
        if process.alive() and run.signalled_at is None and now - run.last_message > limit:
            run.hang_error = (
                f"no progress from the training process for {limit:.0f} s ({phase}); it was killed"
            )
            process.kill()

    def _sync(self, run: Attempt) -> bool:
        return self.writer.sync(run)

    # ---------------------------------------------------------------------------------------
    # The end of an attempt

    def _finish(self, run: Attempt, exitcode: int | None, stored: Outcome | None) -> Outcome:
        outcome = decide(run, exitcode)
        if stored is not None and outcome.status == "succeeded":
            outcome = stored
        run.ending = True  # the flushes below write every sample still held
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

    def _record_outcome(self, run: Attempt, outcome: Outcome) -> Outcome:
        lost = Outcome("lost", "the job was no longer ours when it ended")
        with self.db.write() as session:
            if (
                outcome.status in ("retry", "failed")
                and outcome.error
                and not jobs.record_attempt_error(
                    session,
                    job_id=run.job_id,
                    worker_id=self.worker_id,
                    attempt=run.attempt,
                    error=outcome.error,
                )
            ):
                return lost
            if outcome.status == "retry":
                job = jobs.get_job(session, run.job_id)
                if run.attempt < job.max_attempts:
                    ok = jobs.requeue(
                        session,
                        job_id=run.job_id,
                        worker_id=self.worker_id,
                        rule=self.fair,
                    )
                    return outcome if ok else lost
                outcome = Outcome(
                    "failed",
                    f"{outcome.error} (attempt {run.attempt} of {job.max_attempts}; giving up)",
                )
            if outcome.status == "released":
                asked = run.preempted
                if asked is not None and not preemption.record(
                    session, job_id=run.job_id, worker_id=self.worker_id, request=asked
                ):
                    return lost
                ok = jobs.requeue(
                    session,
                    job_id=run.job_id,
                    worker_id=self.worker_id,
                    count_attempt=False,
                    rule=self.fair,
                )
                return outcome if ok else lost
            ok = jobs.finish(
                session,
                job_id=run.job_id,
                worker_id=self.worker_id,
                status=outcome.status,
                error=outcome.error,
                rule=self.fair,
            )
            if not ok:
                return lost
        checkpoints.remove_all(self.storage.artifacts, str(run.job_id))
        return outcome

    def _refuse_code_job(self, claim: jobs.Claim) -> Outcome | None:
        """Fail a claimed code job whose owner may not run code now (a right revoked, the
        policy tightened or the user disabled while the job waited), before any child
        starts: the right must hold when the code is about to run, not only at submission.
        None to run the job."""
        if claim.spec.get("code") is None:
            return None
        with self.db.write() as session:
            owner = jobs.get_job(session, claim.job_id).owner
            refusal = grants.code_refusal(session, owner, self.settings.code_jobs)
            if refusal is None:
                return None
            error = f"refused when a worker claimed it: {refusal}"
            job_id, worker_id = claim.job_id, self.worker_id
            if not (
                jobs.record_attempt_error(
                    session, job_id=job_id, worker_id=worker_id, attempt=claim.attempt, error=error
                )
                and jobs.finish(
                    session,
                    job_id=job_id,
                    worker_id=worker_id,
                    status="failed",
                    error=error,
                    rule=self.fair,
                )
            ):
                return Outcome("lost", "the job was no longer ours when it was refused")
        # As for any job that failed for good: its checkpoints (of an earlier attempt) go.
        checkpoints.remove_all(self.storage.artifacts, str(claim.job_id))
        return Outcome("failed", error)
