"""The training child: what ``workers.entry`` runs in the job's sandbox.

This module imports nothing heavy at the top: the supervisor names it as the trainer, and
only the child, inside ``run``, imports TensorFlow.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from workers.protocol import JobError


def run(payload: dict[str, Any], conn: Connection) -> None:
    """Train one attempt. Its inputs are staged already (``workers.staging``): the payload
    names the folders, the child opens no store and holds no credential."""
    _die_with_parent(payload.get("parent_pid"))
    job_dir = Path(payload["job_dir"])
    _redirect_output(job_dir / "train.log")
    stop = threading.Event()
    # SIGTERM asks for a clean stop: the current execution finishes, its records are drained
    # and sent, a checkpoint is written. The supervisor sends SIGKILL after a grace period.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the server's terminal is its own
    print(f"halfway: job {payload['job_id']} attempt {payload.get('attempt')} starting", flush=True)
    if payload.get("isolation_warning"):
        print(f"halfway: warning: {payload['isolation_warning']}", flush=True)
    try:
        with _gpu_probe_filtered(not payload.get("gpu_ids")), unused_by_keras(KERAS_EXTRAS):
            # TensorFlow looks for CUDA as it loads and as it first lists devices: both here.
            import tensorflow as tf

            tf.config.list_physical_devices("GPU")
        from workers.context import RunContext
        from workers.training import train

        status = train(
            RunContext(
                job_id=payload["job_id"],
                spec=payload["spec"],
                job_dir=job_dir,
                data_dir=Path(payload["data_dir"]),
                emit=conn.send,
                stop=stop,
                flush_seconds=payload.get("flush_seconds", 0.5),
                gpu_ids=payload.get("gpu_ids") or [],
                resume_step=payload.get("resume_step"),
                attempt=payload.get("attempt") or 1,
                max_parameters=payload.get("max_parameters"),
                precision_decision=payload.get("precision_decision"),
                code_dir=Path(payload["code_dir"]) if payload.get("code_dir") else None,
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


# Keras imports these as it loads when they are installed (the client extra puts them beside
# TensorFlow on a one-host install and in the tests): pandas to accept DataFrames as inputs,
# matplotlib for its plotting helpers. A training child gives Keras numpy arrays or a
# tf.data.Dataset only (workers.usercode refuses anything else) and plots nothing, and loading
# the two is a large share of every child's start (docs/results.md, "A training child's start").
KERAS_EXTRAS = ("pandas", "matplotlib")


@contextlib.contextmanager
def unused_by_keras(names: tuple[str, ...]) -> Iterator[None]:
    """While the block loads TensorFlow and Keras, ``import`` of ``names`` fails as if they
    were not installed (Python's own rule: a name mapped to None in ``sys.modules``), so Keras
    goes without them. Afterwards they import as usual, for the user's own code."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]


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


# What TensorFlow prints as it loads on a host (or in a job) without a GPU: absl's note that
# logging is not set up yet (before the probe's lines on one machine, before oneDNN's notice on
# another, where TensorFlow probes no GPU library at all), "Could not find cuda drivers" (once
# per library that looks) and "failed call to cuInit". Only these lines, whole, are dropped.
_ABSL_NOTE = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
)
_GPU_PROBE = re.compile(
    rb"[IWE]\d{4} [\d:.]+ +\d+ (?:"
    rb"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\."
    rb"|[\w.]+:\d+\] failed call to cuInit: .*"
    rb")"
)


@contextlib.contextmanager
def _gpu_probe_filtered(quiet: bool) -> Iterator[None]:
    """With ``quiet``, while the block runs, fd 1 and 2 (Python's prints and TensorFlow's C++
    logging alike) go through a pipe that a thread copies to the log line by line, in order,
    without TensorFlow's GPU-probe lines. Afterwards they point at the log again, and the
    thread has written everything before the block's exception (if any) is printed.

    Only around TensorFlow's loading, not the whole run: a line still in the pipe when the
    process dies of a signal would be lost, and the probe is over once TensorFlow has loaded."""
    if not quiet:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.dup(2)
    source, sink = os.pipe()
    os.dup2(sink, 1)
    os.dup2(sink, 2)
    os.close(sink)
    copier = threading.Thread(
        target=_copy_without_probe, args=(source, log), name="halfway-log-filter", daemon=True
    )
    copier.start()
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        # The pipe's last write ends close: the copier reads to the end and stops.
        os.dup2(log, 1)
        os.dup2(log, 2)
        # A process started inside the block could keep a write end open: then stop waiting,
        # and the copier goes on writing what it gets.
        copier.join(timeout=30)
        if not copier.is_alive():
            os.close(log)


def _copy_without_probe(source: int, log: int) -> None:
    def write(data: bytes) -> None:
        with contextlib.suppress(OSError):  # a full disk: keep draining, or the writers block
            while data:
                data = data[os.write(log, data) :]

    pending = b""
    while chunk := os.read(source, 65536):
        *lines, pending = (pending + chunk).split(b"\n")
        out = [
            line
            for line in lines
            if not (_GPU_PROBE.fullmatch(bare := line.rstrip(b"\r")) or bare == _ABSL_NOTE)
        ]
        if out:
            write(b"".join(part + b"\n" for part in out))
    os.close(source)
    write(pending)
