"""Where a job's checkpoints live, and the supervisor's housekeeping of them. No TensorFlow:
the supervisor prunes files the training child wrote.

A job resumes only from the checkpoint the supervisor acknowledged, i.e. committed to the
database together with every history row before it; the child may already have written newer
ones, which are kept until a newer acknowledgement supersedes the old."""

from __future__ import annotations

import re
from pathlib import Path

_NAME = re.compile(r"^checkpoint-(\d{12})\.npz(\.part)?$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"checkpoint-{step:012d}.npz"


def _steps(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return found


def prune(directory: Path, acknowledged: int) -> None:
    """Delete the checkpoints older than the acknowledged one (it and newer ones stay)."""
    for step, path in _steps(directory):
        if step < acknowledged:
            path.unlink(missing_ok=True)


def remove_all(directory: Path) -> None:
    """A job that has ended for good needs no checkpoint (they are as large as the model and
    its optimizer state)."""
    for _, path in _steps(directory):
        path.unlink(missing_ok=True)
