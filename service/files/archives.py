"""Unpacking an archive a user sent (a ``.zip`` or a ``.tar.gz``: code bundles, and the code
store's own tarballs), bounded and checked.

Nothing here imports or runs what it unpacks: the archive is read member by member, every
member is checked before a byte of it lands on disk (no path that escapes the root, no links,
no devices, a bounded number of files, folders and bytes, no compression bomb, names in
UTF-8). What headers announce (a tar's extended headers, a zip's central directory) is bounded
before the reader allocates it: an upload costs the API a few MB, whatever it declares.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Literal

from service.errors import SpecError

CHUNK = 1 << 20
# Source code compresses 3-10x; an archive that inflates more than this (once past
# BOMB_FLOOR bytes unpacked) is refused as a compression bomb.
BOMB_FLOOR = 1 << 20
# tarfile reads an extended header whole, at the size its 512-byte header declares (a .tar.gz
# under 1 MB can declare 400 MB). A real one holds a path (PATH_MAX is 4096 bytes) and a few
# fields. Small also because Python before 3.11.10 parses a PAX header with a regex quadratic
# in a run of digits (CVE-2024-6232): 8 KiB costs at most ~0.1 s, 64 KiB 8 s.
HEADER_MAX = 8 << 10
_EXTENDED = (b"x", b"g", b"X", b"L", b"K")  # PAX, PAX global, Solaris PAX, GNU long name, link
# A real archive puts at most 'g', 'x', 'K' and 'L' before a member; tarfile recurses once for
# each, so a chain of thousands ended in a RecursionError.
HEADERS_MAX = 8
# A zip's central directory, on average per record (real ones run 60-300 bytes).
DIRECTORY_RECORD_MAX = 1 << 10


class BundleError(SpecError):
    """An upload that is not an acceptable bundle; ``rule`` names why."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__("file", rule, message)


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_files: int
    max_ratio: float


def save(upload: IO[bytes], path: Path, max_bytes: int) -> int:
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


def unpack(archive: Path, compressed: int, tree: Path, limits: Limits) -> tuple[int, int]:
    with open(archive, "rb") as f:
        magic = f.read(4)
    if magic.startswith(b"PK\x03\x04") or magic.startswith(b"PK\x05\x06"):
        return _unpack_zip(archive, compressed, tree, limits)
    if magic.startswith(b"\x1f\x8b"):
        return _unpack_tar(archive, compressed, tree, limits)
    raise BundleError("not_an_archive", "is neither a .zip nor a .tar.gz archive")


class _Budget:
    """Counts what is unpacked and refuses, as soon as it is passed, each limit. Folders count
    against the file limit as files do (named, and implied by a path when ``implied``), and
    metadata (tar extended headers) against the byte and ratio limits."""

    def __init__(self, compressed: int, limits: Limits, implied: bool = True) -> None:
        self.compressed = max(compressed, 1)
        self.limits = limits
        self.implied = implied
        self.files = 0  # reported: the bundle's files
        self.entries = 0  # files and folders, against max_files
        self.bytes = 0  # reported: the files' contents
        self.metadata = 0
        self.folders: set[str] = set()

    def file(self, path: str) -> None:
        if self.implied:
            self.folder(path.rpartition("/")[0])
        self.files += 1
        self.entry()

    def folder(self, path: str) -> None:
        while path and path not in self.folders:
            self.folders.add(path)
            self.entry()
            path = path.rpartition("/")[0] if self.implied else ""

    def entry(self) -> None:
        self.entries += 1
        if self.entries > self.limits.max_files:
            raise BundleError(
                "too_many_files",
                f"holds more than {self.limits.max_files} files and folders "
                "(HALFWAY_MAX_CODE_FILES)",
            )

    def add(self, n: int) -> None:
        self.bytes += n
        self._check()

    def header(self, n: int) -> None:
        self.metadata += n
        self._check()

    def _check(self) -> None:
        total = self.bytes + self.metadata
        if total > self.limits.max_bytes:
            raise BundleError(
                "too_large",
                f"unpacks to more than {self.limits.max_bytes} bytes (HALFWAY_MAX_CODE_BYTES)",
            )
        ratio = total / self.compressed
        if total > BOMB_FLOOR and ratio > self.limits.max_ratio:
            raise BundleError(
                "compression_bomb",
                f"inflates {ratio:.0f}x (over {self.limits.max_ratio:g}x); this looks like "
                "a compression bomb, not source code",
            )


def _member_path(name: str) -> str:
    """The member's path relative to the bundle root, or a refusal naming it."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        # tarfile decodes with surrogateescape: the escapes give back the archive's bytes.
        raw = name.encode("utf-8", "surrogateescape")
        raise BundleError("not_utf8", f"member {raw!r} has a name that is not UTF-8") from None
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
    except OSError as exc:
        raise _name_error(exc, path) from None
    with out:
        while chunk := source.read(CHUNK):
            budget.add(len(chunk))
            out.write(chunk)


def _folder(tree: Path, path: str) -> None:
    try:
        (tree / path).mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise BundleError("duplicate", f"member {path!r} is both a file and a folder") from None
    except OSError as exc:
        raise _name_error(exc, path) from None


def _name_error(exc: OSError, path: str) -> Exception:
    if exc.errno == errno.ENAMETOOLONG:
        return BundleError("bad_name", f"member {path!r} has a name too long for a file system")
    return exc


def _unpack_zip(archive: Path, compressed: int, tree: Path, limits: Limits) -> tuple[int, int]:
    budget = _Budget(compressed, limits)
    _check_zip_directory(archive, limits)
    try:
        # Names are UTF-8 with or without the zip's flag for it (Info-ZIP and others leave
        # it unset): a name that is not is refused, not read as the CP437 of old DOS.
        zf = zipfile.ZipFile(archive, metadata_encoding="utf-8")
    except UnicodeDecodeError:
        raise BundleError("not_utf8", "a member has a name that is not UTF-8") from None
    except (zipfile.BadZipFile, OSError):
        raise BundleError("not_an_archive", "is not a readable .zip archive") from None
    with zf:
        infos = zf.infolist()
        for info in infos:
            _check_zip_member(info)
        for info in infos:
            path = _member_path(info.filename)
            if not path:
                continue
            if info.is_dir():
                budget.folder(path)
                _folder(tree, path)
                continue
            budget.file(path)
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


def _check_zip_directory(archive: Path, limits: Limits) -> None:
    """Walk the central directory as ZipFile will, before it builds an object of ~500 bytes
    for every 46-byte record at once: count the records (files and folders, against the file
    limit), check each name is UTF-8 and bound the directory's size. What this cannot read,
    ZipFile refuses."""
    counter = _Budget(1, limits)
    with open(archive, "rb") as f:
        try:
            # ZipFile's own reader of the end record (zip64 included): this walk and ZipFile
            # agree on where the directory starts and how long it is.
            end = zipfile._EndRecData(f)  # type: ignore[attr-defined]
        except (OSError, zipfile.BadZipFile):
            return
        if not end:
            return
        size, location, zip64 = end[5], end[9], end[0] == b"PK\x06\x06"
        f.seek(max(location - size - (76 if zip64 else 0), 0))  # zip64 end record and locator
        walked = 0
        while walked < size:
            record = f.read(46)
            if len(record) != 46 or record[:4] != b"PK\x01\x02":
                break
            lengths = struct.unpack_from("<3H", record, 28)  # name, extra field, comment
            name = f.read(lengths[0])
            f.seek(lengths[1] + lengths[2], io.SEEK_CUR)
            walked += 46 + sum(lengths)
            counter.entry()
            try:
                name.decode("utf-8")
            except UnicodeDecodeError:
                raise BundleError(
                    "not_utf8", f"member {name!r} has a name that is not UTF-8"
                ) from None
    if size > (counter.entries + 1) * DIRECTORY_RECORD_MAX:
        raise BundleError(
            "header_too_large",
            f"its central directory declares {size} bytes for {counter.entries} members",
        )


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
    as an upload's are: the store is another party, and an object there may have been changed.
    Its limits are one member a block, so folders a path implies (no block of their own)
    are not counted: they were at upload."""
    return _unpack_tar(archive, archive.stat().st_size, tree, limits, "r:")


def _unpack_tar(
    archive: Path, compressed: int, tree: Path, limits: Limits, mode: Literal["r:gz", "r:"] = "r:gz"
) -> tuple[int, int]:
    budget = _Budget(compressed, limits, implied=mode == "r:gz")
    kind = ".tar.gz" if mode == "r:gz" else ".tar"
    with contextlib.ExitStack() as stack:
        stream: io.BufferedIOBase = stack.enter_context(open(archive, "rb"))
        if mode == "r:gz":
            stream = stack.enter_context(gzip.GzipFile(fileobj=stream, mode="rb"))
        try:
            tf = stack.enter_context(_TarFile(stream, budget))
        except (tarfile.TarError, OSError, EOFError):
            raise BundleError("not_an_archive", f"is not a readable {kind} archive") from None
        try:
            _unpack_members(tf, tree, budget)
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise BundleError("not_an_archive", f"the {kind} is damaged: {exc}") from None
    return budget.files, budget.bytes


def _unpack_members(tf: _TarFile, tree: Path, budget: _Budget) -> None:
    for info in _tar_members(tf):
        path = _member_path(info.name)
        if info.issym() or info.islnk():
            raise BundleError("link", f"member {info.name!r} is a link")
        if info.isdir():
            if path:
                budget.folder(path)
                _folder(tree, path)
            continue
        if not info.isreg():
            raise BundleError(
                "special_file", f"member {info.name!r} is a device, FIFO or other special file"
            )
        if not path:
            raise BundleError("bad_name", f"member {info.name!r} has no file name")
        budget.file(path)
        source = tf.extractfile(info)
        assert source is not None  # a regular member always has contents
        with source:
            _write(tree, path, source, budget)


def _tar_members(tf: _TarFile) -> Iterator[tarfile.TarInfo]:
    """Members one at a time (``getmembers`` would read a whole bomb's headers first), none
    kept: TarFile.next appends each to ``members``, which nothing here looks up."""
    while (info := tf.next()) is not None:
        tf.members.clear()
        yield info


class _TarFile(tarfile.TarFile):
    """A tar read with ``_TarInfo`` headers, carrying what they count against. A name that is
    not UTF-8 is read with surrogate escapes, for ``_member_path`` to refuse."""

    members: list[tarfile.TarInfo]

    def __init__(self, stream: io.BufferedIOBase, budget: _Budget) -> None:
        self.budget = budget
        self.chain = 0  # extended headers before the member being read
        self.global_bytes = 0  # PAX global headers accumulate in tarfile's pax_headers
        super().__init__(
            fileobj=stream, mode="r", tarinfo=_TarInfo, encoding="utf-8", errors="surrogateescape"
        )


class _TarInfo(tarfile.TarInfo):
    """A tar header checked before tarfile reads what it announces (an extended header's data,
    in one read of its declared size; a GNU sparse map, for as long as it says). tarfile calls
    ``_proc_member`` once the 512-byte header is parsed, and its source names it as the method
    a subclass overrides: a bound on tarfile's own reading, not a second parser of the format
    that could disagree with tarfile on where a header starts."""

    def _proc_member(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        assert isinstance(tf, _TarFile)
        if self.type == tarfile.GNUTYPE_SPARSE:
            self._refuse_sparse(self)
        if self.type not in _EXTENDED:
            return self._proc(tf)
        tf.global_bytes += self.size if self.type == tarfile.XGLTYPE else 0
        if max(self.size, tf.global_bytes) > HEADER_MAX:
            raise BundleError(
                "header_too_large",
                f"an extended header (PAX or GNU long name) declares {self.size} bytes "
                f"(global ones {tf.global_bytes} in all), over {HEADER_MAX}",
            )
        tf.budget.header(self.size)
        tf.chain += 1
        if tf.chain > HEADERS_MAX:
            raise BundleError("too_many_headers", f"over {HEADERS_MAX} extended headers in a row")
        try:
            return self._proc(tf)
        finally:
            tf.chain -= 1

    def _proc(self, tf: tarfile.TarFile) -> tarfile.TarInfo:
        info: tarfile.TarInfo = super()._proc_member(tf)  # type: ignore[misc]
        return info

    def _refuse_sparse(self, member: tarfile.TarInfo, *_: object) -> None:
        raise BundleError("special_file", f"member {member.name!r} is a sparse file")

    # GNU sparse maps announced by a PAX header: versions 0.0 and 0.1 are in the (bounded)
    # header, 1.0 is read from the member's data until its count of numbers is met.
    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse
