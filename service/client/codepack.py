"""Packing a directory into a code bundle (``halfway code push``, ``submit --code``): a
``.tar.gz`` of its files relative to the directory, skipping what never belongs in one
(``.git``, ``__pycache__``, virtual environments) and what ``.halfwayignore`` names."""

from __future__ import annotations

import fnmatch
import io
import os
import tarfile
from pathlib import Path

ALWAYS_SKIPPED = (
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
    "*.pyc",
    ".halfwayignore",
)
IGNORE_FILE = ".halfwayignore"


def ignore_patterns(root: Path) -> list[str]:
    """Lines of ``.halfwayignore`` (shell patterns, as in .gitignore but without negation),
    matched against each path relative to the root and against its name."""
    path = root / IGNORE_FILE
    if not path.is_file():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line.rstrip("/") for line in lines if line and not line.startswith("#")]


def _is_venv(path: Path) -> bool:
    return (path / "pyvenv.cfg").is_file() or (path / "conda-meta").is_dir()


def _skipped(relative: str, name: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatch(name, p) or fnmatch.fnmatch(relative, p)
        for p in (*ALWAYS_SKIPPED, *patterns)
    )


def files(root: Path) -> list[str]:
    """The paths a bundle of ``root`` holds, relative and sorted. Symbolic links are not
    followed or packed: a bundle holds regular files only."""
    patterns = ignore_patterns(root)
    out: list[str] = []
    for dirpath, dirs, names in os.walk(root):
        here = Path(dirpath)
        kept = []
        for d in sorted(dirs):
            rel = (here / d).relative_to(root).as_posix()
            if (here / d).is_symlink() or _skipped(rel, d, patterns) or _is_venv(here / d):
                continue
            kept.append(d)
        dirs[:] = kept
        for name in names:
            path = here / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink() or not path.is_file() or _skipped(rel, name, patterns):
                continue
            out.append(rel)
    return sorted(out)


def pack(root: Path) -> bytes:
    """A .tar.gz of the bundle's files with fixed metadata, so the same files pack alike."""
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a directory")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for rel in files(root):
            data = (root / rel).read_bytes()
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
