"""Entry point of the training child process (started with multiprocessing *spawn*).

This module imports nothing heavy at the top: the supervisor names it as the trainer, and
only the child, inside ``run``, imports TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workers.protocol import JobError

if TYPE_CHECKING:
    from workers.staging import JobFiles


def run(payload: dict[str, Any], conn: Connection) -> None:
    _die_with_parent(payload.get("parent_pid"))
    try:
        files, data_dir = _stage(payload)
    except Exception as exc:  # the store unreachable: perhaps transient, so a retry
        message = f"could not stage the job's files: {type(exc).__name__}: {exc}"
        conn.send({"type": "done", "status": "failed", "error": message, "retryable": True})
        conn.close()
        return
    job_dir = files.local_dir
    _redirect_output(job_dir / "train.log")
    stop = threading.Event()
    files.start_shipping(shipped := threading.Event())
    # SIGTERM asks for a clean stop: the current execution finishes, its records are drained
    # and sent, a checkpoint is written. The supervisor sends SIGKILL after a grace period.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the server's terminal is its own
    gpu_ids = payload.get("gpu_ids") or []
    os.environ.update(device_env(gpu_ids))
    print(f"halfway: job {payload['job_id']} attempt {payload.get('attempt')} starting", flush=True)
    try:
        from workers.context import RunContext
        from workers.staging import code_dir_for, open_payload_storage
        from workers.training import train

        # Here, not in _stage, so the job's log says where the bundle came from, and a bundle
        # that fails its digest fails the job like any JobError (no retry).
        code_dir = code_dir_for(
            open_payload_storage(payload), payload["spec"], _code_cache(payload)
        )

        status = train(
            RunContext(
                job_id=payload["job_id"],
                spec=payload["spec"],
                job_dir=job_dir,
                data_dir=data_dir,
                emit=conn.send,
                stop=stop,
                flush_seconds=payload.get("flush_seconds", 0.5),
                gpu_ids=gpu_ids,
                resume_step=payload.get("resume_step"),
                attempt=payload.get("attempt") or 1,
                max_parameters=payload.get("max_parameters"),
                code_dir=code_dir,
                files=files,
            )
        )
        conn.send({"type": "done", "status": status, "error": None, "retryable": False})
    except JobError as exc:
        # A failure in the user's code has its traceback in the log already.
        print(f"halfway: job failed: {exc}", flush=True)
        conn.send({"type": "done", "status": "failed", "error": str(exc), "retryable": False})
    except BaseException as exc:  # anything else: report it, let the supervisor decide on a retry
        traceback.print_exc()
        sys.stderr.flush()
        message = f"{type(exc).__name__}: {exc}".strip()
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send({"type": "done", "status": "failed", "error": message, "retryable": True})
    finally:
        conn.close()
    print("halfway: child exiting", flush=True)
    shipped.set()
    with contextlib.suppress(Exception):
        files.ship()
    files.clean_scratch()


def _stage(payload: dict[str, Any]) -> tuple[JobFiles, Path]:
    """The job's local directory (in the store, or scratch for a remote one) with the log of
    earlier attempts, and a local directory holding its dataset."""
    from workers.staging import JobFiles, data_dir_for, open_payload_storage

    storage = open_payload_storage(payload)
    scratch = Path(payload["scratch_dir"])
    files = JobFiles.for_job(storage, payload["job_id"], scratch)
    files.restore_log()
    return files, data_dir_for(storage, payload["spec"], scratch)


def _code_cache(payload: dict[str, Any]) -> Path:
    """This host's cache of code bundles (HALFWAY_CODE_DIR), shared by its jobs."""
    if payload.get("code_dir"):
        return Path(payload["code_dir"])
    return Path(payload["scratch_dir"]) / "code"


def device_env(gpu_ids: list[int]) -> dict[str, str]:
    """The environment a child needs before TensorFlow initialises CUDA: only its slot's GPUs
    visible (none for a CPU job, so it cannot grab a GPU by accident), and memory taken as
    needed rather than all at once."""
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpu_ids) if gpu_ids else "-1",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1"),
    }


def _die_with_parent(parent_pid: int | None) -> None:
    """Ask Linux to SIGKILL us if our parent (the supervisor, or the Ray actor that started
    us) dies, so an orphan never keeps training (and holding a GPU) while another worker
    reclaims the job.

    The launcher hands us its pid: "my parent is now PID 1" does not mean it died when the
    supervisor itself is PID 1 (a container without an init process)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the supervisor died before prctl took effect: we were reparented


def _redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr, TensorFlow's C++ logging included, to the log."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
