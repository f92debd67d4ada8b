"""One attempt of a job, as its supervisor follows it: the mutable state (``Attempt``), how
it ended (``Outcome``) and the rule that decides that from what the child said and how it
exited (``decide``). No TensorFlow, no database."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

from service.recording.heldflush import Held
from service.recording.records import StepRecord
from service.scheduling.preemption import Request
from workers.protocol import Done


@dataclass
class Outcome:
    """How one attempt ended, as the supervisor saw it."""

    status: str  # succeeded | failed | cancelled | released | retry | lost
    error: str | None = None


@dataclass
class Attempt:
    """The mutable state of one running attempt."""

    job_id: int
    attempt: int
    resume_step: int | None = None  # the acknowledged checkpoint the attempt was given
    missing_checkpoint: str | None = None  # why it started over instead, to record
    pending: list[StepRecord] = field(default_factory=list)
    updates: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] | None = None
    # Each epoch's metrics not yet written (``epochmetrics.clean_epoch``), for the general flush.
    new_epochs: list[dict[str, Any]] = field(default_factory=list)
    new_warnings: list[str] = field(default_factory=list)
    new_forensics: list[dict[str, Any]] = field(default_factory=list)
    new_notes: list[str] = field(default_factory=list)
    # Gradient samples not yet written (cleaned, in step order), and when the oldest of them
    # arrived (monotonic): they ride the general flush, which they force only once that is
    # GRADIENTS_HOLD_SECONDS ago (workers/flush.py).
    new_gradients: list[dict[str, Any]] = field(default_factory=list)
    gradients_since: float | None = None
    # The attempt has ended: its last flushes must write everything it holds.
    ending: bool = False
    pid: int | None = None
    placement: dict[str, str] = field(default_factory=dict)
    truncate_at: int | None = None
    steps_per_second: float | None = None
    done: Done | None = None
    started: bool = False
    # What the child said it is compiling, until its next message (the watchdog's grace).
    compiling: str | None = None
    cancel_requested: bool = False
    shutting_down: bool = False
    # A waiting job's request that this attempt stop (service/scheduling/preemption.py): it then
    # stops as a shutdown does, and the job goes back to the queue with the preemption recorded.
    preempted: Request | None = None
    preempt_looked_at: float = 0.0
    lease_lost: bool = False
    signalled_at: float | None = None
    hang_error: str | None = None
    death: str | None = None  # why the launcher lost the child (a Ray node died)
    last_message: float = field(default_factory=time.monotonic)
    last_sync: float = 0.0
    next_db_try: float = 0.0
    db_backoff: float = 0.25
    db_down_since: float | None = None
    # Rows committed without waiting for the disk (see _sync), kept until a commit that waits.
    unsynced: list[StepRecord] = field(default_factory=list)
    relaxed_flushes: int = 0
    # Where the job's history ended after our last write, for the one-statement flush.
    held: Held | None = None
    # When the last renewal that succeeded was sent (monotonic): the lease holds until at
    # least lease_seconds after it, and store writes are made only within that (the fence).
    renewed_at: float = field(default_factory=time.monotonic)
    shipped_at: float = 0.0
    saved: list[str] = field(default_factory=list)  # files the child saved, to publish


def decide(run: Attempt, exitcode: int | None) -> Outcome:
    """How an attempt ended, from what its child said and how it exited."""
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
    if run.death is not None:
        return Outcome("retry", run.death)
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown"
        return Outcome("retry", f"training process killed by signal {-exitcode} ({name})")
    return Outcome("retry", f"training process exited with code {exitcode} without a result")
