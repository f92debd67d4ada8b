"""What one training run is given (RunContext: the spec, its directories, the pipe back to
the supervisor, the stop flag, the acknowledged checkpoint), and how a full disk is reported."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.protocol import JobError, Message

Emit = Callable[[Message], None]


@dataclass
class RunContext:
    job_id: int
    spec: dict[str, Any]
    job_dir: Path
    data_dir: Path
    emit: Emit
    stop: threading.Event
    flush_seconds: float = 0.5
    gpu_ids: list[int] = field(default_factory=list)
    resume_step: int | None = None  # the checkpoint the supervisor acknowledged
    attempt: int = 1
    max_parameters: int | None = None  # the server's limit, for models sized only here
    code_dir: Path | None = None  # the code bundle's tree, read-only (code jobs)
    # Policy "auto": the choice an earlier attempt made (and the job recorded), if any.
    precision_decision: dict[str, Any] | None = None


SCRATCH_VOLUME = "the worker's scratch volume (HALFWAY_SCRATCH_DIR)"
ARTIFACT_VOLUME = "the artifact volume (HALFWAY_ARTIFACT_DIR)"


@contextlib.contextmanager
def disk_errors_explained(directory: Path, volume: str = SCRATCH_VOLUME) -> Iterator[None]:
    """A full disk (or quota) is the job's to report, clearly and without a retry that would
    fail the same way; the worker itself is unaffected. The child writes to its scratch
    folder, the supervisor from there to the store: ``volume`` says which one to free."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise JobError(
                f"no space left writing to {directory} ({os.strerror(exc.errno)}): free space "
                f"on {volume} and submit again"
            ) from None
        raise
