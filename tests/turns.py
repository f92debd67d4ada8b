"""Turns on the shared PostgreSQL server when the tests run in several processes
(pytest-xdist, as ``.ci/run`` runs them): a test marked ``restarts_postgresql`` runs alone,
every other test waits while it does (the fixtures that take the turns are in conftest.py).
Without xdist there is one process and nothing to wait for.

A turnstile of two ``flock`` files, shared by the workers of one run: a test takes the gate,
then the server (shared, or exclusive for a restart), and an ordinary test lets go of the
gate at once. A restart waiting for the tests in progress holds the gate, so the other
process cannot start test after test ahead of it."""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def _locked(path: Path, mode: int) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# This thread holds a turn: one asked for inside it (a fixture a test sets up) is that one.
_local = threading.local()


@contextmanager
def turn(lock_dir: Path | None, *, exclusive: bool) -> Iterator[None]:
    """Hold the server for a test: alone if ``exclusive``."""
    if lock_dir is None or getattr(_local, "held", False):
        yield
        return
    gate, server = lock_dir / "postgresql.gate", lock_dir / "postgresql.lock"
    _local.held = True
    try:
        if exclusive:
            with _locked(gate, fcntl.LOCK_EX), _locked(server, fcntl.LOCK_EX):
                yield
            return
        with _locked(gate, fcntl.LOCK_EX):
            f = server.open("a")
            fcntl.flock(f, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
    finally:
        _local.held = False
