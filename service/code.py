"""Code bundles: a team's own training code, uploaded as a ``.zip`` or ``.tar.gz``, checked
and unpacked here, and named by its content (``sha256:<hex>``). Where bundles are kept (the
store, each host's cache) is ``service/codestore.py``.

Nothing here imports or runs the code: the archive is read member by member, every member is
checked before a byte of it lands on disk (no path that escapes the root, no links, no
devices, a bounded number of files and bytes, no compression bomb), and the digest is taken
over the unpacked tree (paths and contents), so the same files give the same digest whether
they came as a zip or a tarball. A refused archive leaves nothing behind.

Only the training child ever puts a bundle on ``sys.path`` (``workers/usercode.py``).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import os
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Literal

from service.errors import SpecError

DIGEST_PREFIX = "sha256:"
CHUNK = 1 << 20
# Source code compresses 3-10x; an archive that inflates more than this (once past
# BOMB_FLOOR bytes unpacked) is refused as a compression bomb.
BOMB_FLOOR = 1 << 20


class BundleError(SpecError):
    """An upload that is not an acceptable bundle; ``rule`` names why."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__("file", rule, message)


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_files: int
    max_ratio: float


@dataclass(frozen=True)
class Unpacked:
    tree: Path
    files: int
    bytes: int


def unpack_upload(upload: IO[bytes], work: Path, limits: Limits) -> Unpacked:
    """Check and unpack an uploaded archive into ``work/tree`` (``work`` is the caller's to
    remove, whatever happens)."""
    archive = work / "archive"
    compressed = _save(upload, archive, limits.max_bytes)
    tree = work / "tree"
    tree.mkdir()
    count, total = _unpack(archive, compressed, tree, limits)
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
# Unpacking


def _save(upload: IO[bytes], path: Path, max_bytes: int) -> int:
    size = 0
    with open(path, "wb") as out:
        while chunk := upload.read(CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise BundleError(
                    "too_large",
                    f"the archive is over {max_bytes} bytes (HALFWAY_MAX_CODE_BYTES)",
                )
            out.write(chunk)
    return size


def _unpack(archive: Path, compressed: int, tree: Path, limits: Limits) -> tuple[int, int]:
    with open(archive, "rb") as f:
        magic = f.read(4)
    if magic.startswith(b"PK\x03\x04") or magic.startswith(b"PK\x05\x06"):
        return _unpack_zip(archive, compressed, tree, limits)
    if magic.startswith(b"\x1f\x8b"):
        return _unpack_tar(archive, compressed, tree, limits)
    raise BundleError("not_an_archive", "is neither a .zip nor a .tar.gz archive")


class _Budget:
    """Counts what is unpacked and refuses, as soon as it is passed, each limit."""

    def __init__(self, compressed: int, limits: Limits) -> None:
        self.compressed = max(compressed, 1)
        self.limits = limits
        self.files = 0
        self.bytes = 0

    def file(self) -> None:
        self.files += 1
        if self.files > self.limits.max_files:
            raise BundleError(
                "too_many_files",
                f"holds more than {self.limits.max_files} files (HALFWAY_MAX_CODE_FILES)",
            )

    def add(self, n: int) -> None:
        self.bytes += n
        if self.bytes > self.limits.max_bytes:
            raise BundleError(
                "too_large",
                f"unpacks to more than {self.limits.max_bytes} bytes (HALFWAY_MAX_CODE_BYTES)",
            )
        ratio = self.bytes / self.compressed
        if self.bytes > BOMB_FLOOR and ratio > self.limits.max_ratio:
            raise BundleError(
                "compression_bomb",
                f"inflates {ratio:.0f}x (over {self.limits.max_ratio:g}x); this looks like "
                "a compression bomb, not source code",
            )


def _member_path(name: str) -> str:
    """The member's path relative to the bundle root, or a refusal naming it."""
    if "\x00" in name or "\\" in name:
        raise BundleError("bad_name", f"member {name!r} has a NUL or a backslash in its name")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise BundleError("absolute_path", f"member {name!r} is an absolute path")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise BundleError("path_escape", f"member {name!r} escapes the bundle root ('..')")
    return "/".join(parts)


def _write(tree: Path, path: str, source: IO[bytes], budget: _Budget) -> None:
    target = tree / path
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        out = open(target, "xb")  # noqa: SIM115 (closed by the with below)
    except (FileExistsError, NotADirectoryError, IsADirectoryError):
        raise BundleError(
            "duplicate", f"member {path!r} appears twice, or as both a file and a folder"
        ) from None
    with out:
        while chunk := source.read(CHUNK):
            budget.add(len(chunk))
            out.write(chunk)


def _folder(tree: Path, path: str) -> None:
    try:
        (tree / path).mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise BundleError("duplicate", f"member {path!r} is both a file and a folder") from None


def _unpack_zip(archive: Path, compressed: int, tree: Path, limits: Limits) -> tuple[int, int]:
    budget = _Budget(compressed, limits)
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError):
        raise BundleError("not_an_archive", "is not a readable .zip archive") from None
    with zf:
        infos = zf.infolist()
        for info in infos:
            _check_zip_member(info)
        if sum(not i.is_dir() for i in infos) > limits.max_files:
            budget.files = limits.max_files  # the central directory says so: refuse now
            budget.file()
        for info in infos:
            path = _member_path(info.filename)
            if not path:
                continue
            if info.is_dir():
                _folder(tree, path)
                continue
            budget.file()
            try:
                with zf.open(info) as source:
                    _write(tree, path, source, budget)
            except (
                zipfile.BadZipFile,
                RuntimeError,
                NotImplementedError,
                EOFError,
                zlib.error,
            ) as exc:
                raise BundleError(
                    "not_an_archive", f"member {path!r} cannot be read: {exc}"
                ) from None
    return budget.files, budget.bytes


def _check_zip_member(info: zipfile.ZipInfo) -> None:
    _member_path(info.filename)
    mode = info.external_attr >> 16
    # Unix attributes carry the file type (many writers leave it 0: a plain file).
    if info.create_system == 3 and stat.S_IFMT(mode):
        if stat.S_ISLNK(mode):
            raise BundleError("link", f"member {info.filename!r} is a symbolic link")
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise BundleError(
                "special_file", f"member {info.filename!r} is not a regular file or directory"
            )


def unpack_tar(archive: Path, tree: Path, limits: Limits) -> tuple[int, int]:
    """Unpack an uncompressed tar (a bundle as the store holds it) with every member checked
    as an upload's are: the store is another party, and an object there may have been changed."""
    return _unpack_tar(archive, archive.stat().st_size, tree, limits, "r:")


def _unpack_tar(
    archive: Path, compressed: int, tree: Path, limits: Limits, mode: Literal["r:gz", "r:"] = "r:gz"
) -> tuple[int, int]:
    budget = _Budget(compressed, limits)
    kind = ".tar.gz" if mode == "r:gz" else ".tar"
    try:
        tf = tarfile.open(archive, mode)  # noqa: SIM115 (closed by the with below)
    except (tarfile.TarError, OSError, EOFError):
        raise BundleError("not_an_archive", f"is not a readable {kind} archive") from None
    try:
        with tf:
            for info in _tar_members(tf):
                path = _member_path(info.name)
                if info.issym() or info.islnk():
                    raise BundleError("link", f"member {info.name!r} is a link")
                if info.isdir():
                    if path:
                        _folder(tree, path)
                    continue
                if not info.isreg():
                    raise BundleError(
                        "special_file",
                        f"member {info.name!r} is a device, FIFO or other special file",
                    )
                if not path:
                    raise BundleError("bad_name", f"member {info.name!r} has no file name")
                budget.file()
                source = tf.extractfile(info)
                assert source is not None  # a regular member always has contents
                with source:
                    _write(tree, path, source, budget)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise BundleError("not_an_archive", f"the {kind} is damaged: {exc}") from None
    return budget.files, budget.bytes


def _tar_members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """Members one at a time (``getmembers`` would read a whole bomb's headers first)."""
    while (info := tf.next()) is not None:
        yield info


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
