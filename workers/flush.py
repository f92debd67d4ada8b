"""The supervisor's writes of one attempt's history and updates to the database, each with a
renewal of its lease (fenced by ``worker_id``): the common history-only flush in one
statement on PostgreSQL (``service.recording.heldflush``), else the general transaction. A database
that does not answer keeps everything pending for the next try. No TensorFlow.

Gradient samples go in the general transaction only. They do not force it at once: a job
sampling every few steps would otherwise never take the one-statement flush. They ride the
next general flush (anything else pending forces one: a checkpoint's acknowledgement, a
truncation, metrics, the attempt's end), or force one themselves when the oldest of them
has waited ``GRADIENTS_HOLD_SECONDS``."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from sqlalchemy.exc import DBAPIError

from service.database.db import Database
from service.files.storage import Store
from service.metrics import HISTORY_WRITE_LATENCY
from service.recording import epochmetrics, gradients, history
from service.recording.heldflush import Held, HeldAppender
from service.recording.records import StepRecord
from service.scheduling import jobs
from service.settings import Settings
from workers import checkpoints
from workers.attempt import Attempt

log = logging.getLogger("halfway.worker")

DB_RETRY_MAX_SECONDS = 5.0
# At most this many flushes in a row commit without waiting for the disk; the next one waits.
RELAXED_FLUSHES = 8
# The longest a gradient sample waits for a general flush to ride before it forces one.
GRADIENTS_HOLD_SECONDS = 5.0


class HistoryWriter:
    def __init__(
        self,
        db: Database,
        settings: Settings,
        worker_id: str,
        appender: HeldAppender | None,
        artifacts: Store,
    ) -> None:
        self.db, self.settings, self.worker_id, self.appender = db, settings, worker_id, appender
        self.artifacts = artifacts  # where an acknowledged checkpoint's predecessors are pruned

    def _context(self, job_id: int) -> dict[str, object]:
        return {"job_id": job_id, "worker_id": self.worker_id}

    def sync(self, run: Attempt) -> bool:
        """Write pending history and updates and renew the lease, in one transaction. Returns
        False if the database was unreachable (everything stays pending for the next try)."""
        pending = run.pending
        started = time.perf_counter()
        sent_at = time.monotonic()
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
            and not run.new_epochs
            and not run.new_warnings
            and not run.new_forensics
        )
        held = self._append_held(run, pending, durable=not relaxed)
        samples = run.new_gradients
        epochs = run.new_epochs
        wrote_samples = held is None
        if held is None:
            # A commit carrying samples waits for the disk: unlike step rows, they are not
            # kept to be written again should the database lose a relaxed commit.
            relaxed = relaxed and not samples
            try:
                held = self._write(run, pending, samples, epochs, durable=not relaxed)
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
            if held is None:
                run.lease_lost = True
                return True
        run.held = held
        run.renewed_at = sent_at
        HISTORY_WRITE_LATENCY.observe(time.perf_counter() - started)
        acknowledged = run.updates.get("checkpoint_step")
        if acknowledged is not None:
            checkpoints.prune(self.artifacts, str(run.job_id), acknowledged)
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
        run.new_epochs = run.new_epochs[len(epochs) :]
        run.new_warnings = []
        run.new_forensics = []
        run.new_notes = []
        run.truncate_at = None
        run.missing_checkpoint = None
        if wrote_samples:
            run.new_gradients = run.new_gradients[len(samples) :]
            run.gradients_since = None
        run.last_sync = time.monotonic()
        return True

    @staticmethod
    def gradients_due(run: Attempt) -> bool:
        """Whether pending samples must be written now, by the general flush: the oldest has
        waited long enough, or the attempt is ending."""
        if not run.new_gradients:
            return False
        if run.ending or run.gradients_since is None:
            return True
        return time.monotonic() - run.gradients_since >= GRADIENTS_HOLD_SECONDS

    def _append_held(
        self, run: Attempt, pending: list[StepRecord], *, durable: bool
    ) -> Held | None:
        """The common flush, history only, in one statement on the supervisor's own
        connection (``heldflush.HeldAppender``). None when it cannot or did not write: the
        general path (``_write``) then runs, and tells a lost lease from a history that is
        not where we left it."""
        if (
            self.appender is None
            or run.held is None
            or run.truncate_at is not None
            or run.missing_checkpoint is not None
            or run.updates
            or run.metrics is not None
            or run.new_epochs
            or run.new_warnings
            or run.new_forensics
            or run.new_notes
            or self.gradients_due(run)
        ):
            return None
        try:
            written = self.appender.append(
                job_id=run.job_id,
                worker_id=self.worker_id,
                lease_seconds=self.settings.lease_seconds,
                held=run.held,
                records=pending,
                steps_per_second=run.steps_per_second,
                durable=durable,
            )
        except psycopg.OperationalError as exc:  # the general path meets it too, and says so
            log.debug("job %s: one-statement flush failed: %s", run.job_id, exc)
            return None
        except psycopg.Error as exc:  # not an outage: a fault of the statement itself
            log.warning(
                "job %s: one-statement flush failed, taking the general path: %s",
                run.job_id,
                exc,
                extra=self._context(run.job_id),
            )
            return None
        if written is None:
            return None
        run.cancel_requested = run.cancel_requested or written.cancel_requested
        return written.held

    def _write(
        self,
        run: Attempt,
        pending: list[StepRecord],
        samples: list[dict[str, Any]],
        epochs: list[dict[str, Any]],
        *,
        durable: bool,
    ) -> Held | None:
        """The general flush: renew the lease, load the job, write what is pending, in one
        transaction. None if the lease is not ours any more; else where the history ends."""
        with self.db.write() as session:
            job = jobs.renew_and_load(
                session,
                job_id=run.job_id,
                worker_id=self.worker_id,
                lease_seconds=self.settings.lease_seconds,
            )
            if job is None:
                return None
            run.cancel_requested = run.cancel_requested or job.cancel_requested
            now = job.updated_at  # the database's clock
            if run.missing_checkpoint is not None:
                job.notes = [*job.notes, run.missing_checkpoint]
                job.attempt_errors = [
                    *job.attempt_errors,
                    {
                        "attempt": run.attempt,
                        "error": run.missing_checkpoint,
                        "at": now.isoformat(),
                    },
                ]
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
            if run.new_notes:
                job.notes = [*job.notes, *(n for n in run.new_notes if n not in job.notes)]
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
                durable=durable,
            )
            # After the truncation above: a resumed attempt's samples from its cut on replace
            # those of the attempt before, and none of the old ones survives the cut.
            gradients.write_samples(session, job, samples)
            epochmetrics.write_epochs(session, job, epochs)
            return Held.of(job)
