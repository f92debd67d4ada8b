"""Code bundles: a team's own training code, uploaded as a ``.zip`` or ``.tar.gz``, checked
and unpacked (``service/files/archives.py``), and named by its content (``sha256:<hex>``).
Where bundles are kept (the store, each host's cache) is ``service/files/codestore.py``.

Nothing here imports or runs the code. The digest is taken over the unpacked tree (paths and
contents), so the same files give the same digest whether they came as a zip or a tarball. A
refused archive leaves nothing behind.

Only the training child ever puts a bundle on ``sys.path`` (``workers/usercode.py``).
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from service.errors import SpecError
from service.files.archives import CHUNK, save, unpack

# Named here too: callers refuse and bound a bundle as ``code.BundleError`` and ``code.Limits``.
from service.files.archives import BundleError as BundleError
from service.files.archives import Limits as Limits

DIGEST_PREFIX = "sha256:"


@dataclass(frozen=True)
class Unpacked:
    tree: Path
    files: int
    bytes: int


def unpack_upload(upload: IO[bytes], work: Path, limits: Limits) -> Unpacked:
    """Check and unpack an uploaded archive into ``work/tree`` (``work`` is the caller's to
    remove, whatever happens)."""
    archive = work / "archive"
    compressed = save(upload, archive, limits.max_bytes)
    tree = work / "tree"
    tree.mkdir()
    count, total = unpack(archive, compressed, tree, limits)
    archive.unlink()
    if count == 0:
        raise BundleError("empty", "holds no files")
    return Unpacked(tree, count, total)


def hex_of(digest: str) -> str:
    """The 64 hex digits of a ``sha256:`` digest, or a refusal naming the rule."""
    hexdigest = digest.removeprefix(DIGEST_PREFIX)
    if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
        raise SpecError("digest", "pattern", "must be sha256: followed by 64 hex digits")
    return hexdigest


def tree_digest(root: Path) -> str:
    """SHA-256 over each file's path, size and contents, in path order (directories are
    implied by the paths, so an empty directory does not change the digest)."""
    outer = hashlib.sha256()
    for path in files(root):
        inner = hashlib.sha256()
        with open(root / path, "rb") as f:
            while chunk := f.read(CHUNK):
                inner.update(chunk)
        size = (root / path).stat().st_size
        outer.update(f"{path}\0{size}\0{inner.hexdigest()}\n".encode())
    return outer.hexdigest()


def files(root: Path) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            out.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(out)


# --------------------------------------------------------------------------------------------
# Checking an entry point without importing it


def check_entrypoint(root: Path, entrypoint: str) -> None:
    """The module's file is in the bundle and defines the function at its top level. The
    module is parsed with ``ast``, never imported: the API runs nothing of the user's."""
    module, _, function = entrypoint.partition(":")
    parts = module.split(".")
    candidates = [root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        shown = " or ".join(str(c.relative_to(root)) for c in candidates)
        raise SpecError("code.entrypoint", "module_not_found", f"the bundle has no {shown}")
    for depth in range(1, len(parts)):
        package = root.joinpath(*parts[:depth])
        if not package.is_dir():
            raise SpecError(
                "code.entrypoint", "module_not_found", f"the bundle has no package {package}"
            )
    relative = path.relative_to(root).as_posix()
    try:
        tree = ast.parse(path.read_bytes(), filename=relative)
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        where = f"{relative}:{line}" if line else relative
        raise SpecError(
            "code.entrypoint", "syntax_error", f"{where} does not parse: {exc}"
        ) from None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == function:
            if isinstance(node, ast.AsyncFunctionDef):
                raise SpecError(
                    "code.entrypoint",
                    "not_a_function",
                    f"{function} in {relative} is async; the entry point must be a plain def",
                )
            return
    raise SpecError(
        "code.entrypoint",
        "function_not_found",
        f"{relative} defines no top-level function {function!r}",
    )


# --------------------------------------------------------------------------------------------
# Files on disk


def make_read_only(tree: Path) -> None:
    for dirpath, dirs, names in os.walk(tree):
        for name in names:
            os.chmod(Path(dirpath) / name, 0o444)
        for name in dirs:
            os.chmod(Path(dirpath) / name, 0o555)
    os.chmod(tree, 0o555)


def remove(path: Path) -> None:
    if not path.exists():
        return
    # A tree made read-only just before a rename that lost a race: writable again first.
    for dirpath, dirs, _names in os.walk(path):
        for name in dirs:
            os.chmod(Path(dirpath) / name, 0o755)
    os.chmod(path, 0o755)
    shutil.rmtree(path)
