"""The turns the test processes take on the shared PostgreSQL server (``tests/turns.py``):
a restart waits for the tests in progress, and no test starts while it runs."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.turns import turn

ROOT = Path(__file__).resolve().parent.parent
HOLDER = """
import sys
from pathlib import Path
from tests.turns import turn
with turn(Path(sys.argv[1]), exclusive=sys.argv[2] == "exclusive"):
    print("held", flush=True)
    sys.stdin.readline()
"""


@contextmanager
def held_elsewhere(lock_dir: Path, *, exclusive: bool) -> Iterator[subprocess.Popen[str]]:
    """Another process holding a turn until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock_dir), "exclusive" if exclusive else "shared"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def taken_in_thread(lock_dir: Path, *, exclusive: bool) -> tuple[threading.Event, threading.Event]:
    """Take a turn in a thread: (taken, let go) events; set ``let go`` to end it."""
    taken, let_go = threading.Event(), threading.Event()

    def take() -> None:
        with turn(lock_dir, exclusive=exclusive):
            taken.set()
            let_go.wait(60)

    threading.Thread(target=take, daemon=True).start()
    return taken, let_go


@pytest.mark.parametrize(
    ("held", "asked", "waits"),
    [
        ("exclusive", "shared", True),  # no test starts while the server restarts
        ("shared", "exclusive", True),  # a restart waits for the test in progress
        ("shared", "shared", False),  # ordinary tests share the server
    ],
)
def test_turns_on_the_server(tmp_path: Path, held: str, asked: str, waits: bool) -> None:
    with held_elsewhere(tmp_path, exclusive=held == "exclusive"):
        taken, let_go = taken_in_thread(tmp_path, exclusive=asked == "exclusive")
        if waits:
            assert not taken.wait(0.5)
        else:
            assert taken.wait(30)
    assert taken.wait(30)
    let_go.set()
