"""Hostile archives cost the API nothing: a tar whose extension headers (PAX, GNU long names,
GNU sparse maps) declare a huge size, a chain of them, a zip whose central directory holds a
flood of entries, folders past the file limit and names that are not UTF-8 are all refused
with a 422 naming the rule, before the API allocates what the archive asks for. The memory
test runs a real ``halfway serve`` and reads its resident set from ``/proc``."""

from __future__ import annotations

import gzip
import io
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from service.settings import Settings
from tests.apiprocess import ApiProcess
from tests.conftest import Api, Team

MiB = 1 << 20
BLOCK = 512
Format = Literal[0, 1, 2]  # tarfile.USTAR_FORMAT, GNU_FORMAT, PAX_FORMAT


@dataclass(frozen=True)
class Fill:
    """``size`` bytes of ``pattern`` repeated, written to the gzip stream a chunk at a time so
    the test never holds them."""

    pattern: bytes
    size: int


def tar_gz(*parts: bytes | Fill) -> bytes:
    """Raw tar blocks in a gzip stream: what an attacker writes, not what tarfile would."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=9, mtime=0) as gz:
        for part in parts:
            if isinstance(part, bytes):
                gz.write(part)
                continue
            chunk = part.pattern * (MiB // len(part.pattern))
            left = part.size
            while left:
                gz.write(chunk[:left])
                left -= min(left, len(chunk))
    return buffer.getvalue()


def header(
    name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, fmt: Format = tarfile.GNU_FORMAT
) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    # Surrogates in a name stand for the raw bytes an attacker puts there (not UTF-8).
    return info.tobuf(fmt, "utf-8", "surrogateescape")


def member(name: str, data: bytes, fmt: Format = tarfile.GNU_FORMAT) -> bytes:
    padding = -len(data) % BLOCK
    return header(name, size=len(data), fmt=fmt) + data + bytes(padding)


OK = member("pkg/ok.py", b"x = 1\n")
END = bytes(2 * BLOCK)


def with_checksum(block: bytearray) -> bytes:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def pax_huge(size: int) -> bytes:
    """A PAX extended header that declares ``size`` bytes (tarfile read them in one go)."""
    return tar_gz(header("././@PaxHeader", tarfile.XHDTYPE, size), Fill(b"a", size), OK, END)


def gnu_long_huge(size: int) -> bytes:
    """A GNU long name of ``size`` bytes (tarfile read it whole and decoded it to a str)."""
    return tar_gz(header("././@LongLink", tarfile.GNUTYPE_LONGNAME, size), Fill(b"a", size), OK)


def sparse_map(size: int) -> bytes:
    """A GNU sparse 1.0 member (announced in its PAX header) whose map, read from its data,
    runs ``size`` bytes: tarfile kept reading and listing numbers until the count was met."""
    info = tarfile.TarInfo("pkg/s.py")
    info.size = size
    info.pax_headers = {
        "GNU.sparse.major": "1",
        "GNU.sparse.minor": "0",
        "GNU.sparse.name": "pkg/s.py",
        "GNU.sparse.realsize": "1",
    }
    head = info.tobuf(tarfile.PAX_FORMAT)
    count = b"%d\n" % size
    return tar_gz(head, count, Fill(b"1\n", size - len(count)), END)


def gnu_sparse_chain(size: int) -> bytes:
    """An old GNU sparse member ('S') followed by ``size`` bytes of extension blocks, each
    saying another follows: tarfile read them all and listed every entry first."""
    block = bytearray(header("pkg/s.py", tarfile.GNUTYPE_SPARSE, 1))
    block[482] = 1  # isextended
    entry = b"%011o\0" % 1 + b"%011o\0" % 1
    extension = entry * 21 + b"\x01" + bytes(7)
    return tar_gz(with_checksum(block), Fill(extension, size), END)


def header_chain(length: int) -> bytes:
    """``length`` small PAX headers, each announcing the next one (tarfile recursed)."""
    record = b"19 comment=chained\n"
    one = header("././@PaxHeader", tarfile.XHDTYPE, len(record)) + record.ljust(BLOCK, b"\0")
    return tar_gz(one * length, OK, END)


def zip_folders(count: int, files: int = 1) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for i in range(count):
            zf.writestr(zipfile.ZipInfo(f"d{i:x}/"), b"")
        for i in range(files):
            zf.writestr(f"pkg/m{i}.py", b"x = 1\n")
    return buffer.getvalue()


def zip_commented(count: int, comment: int) -> bytes:
    """A zip whose central directory is mostly per-member comments (ZipFile keeps them all)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for i in range(count):
            info = zipfile.ZipInfo(f"pkg/m{i}.py")
            info.comment = b"c" * comment
            zf.writestr(info, b"x = 1\n")
    return buffer.getvalue()


def tar_folders(count: int) -> bytes:
    folders = b"".join(header(f"d{i}", tarfile.DIRTYPE) for i in range(count))
    return tar_gz(folders, OK, END)


def zip_named(raw: bytes, utf8_flag: bool) -> bytes:
    """A zip with one member whose name is ``raw``, as bytes (zipfile writes only UTF-8)."""
    placeholder = b"pkg/" + b"Q" * (len(raw) - 4) if len(raw) > 4 else b"Q" * len(raw)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        info = zipfile.ZipInfo(placeholder.decode())
        if utf8_flag:
            info.flag_bits |= 0x800
        zf.writestr(info, b"x = 1\n")
    data = buffer.getvalue()
    assert data.count(placeholder) == 2  # the local header and the central directory
    return data.replace(placeholder, raw)


NOT_UTF8 = "pkg/caf\udce9.py"  # b"pkg/caf\xe9.py": Latin-1, not UTF-8


def upload(api: Api, data: bytes, name: str = "code.tar.gz") -> Any:
    return api.post("/v1/code", files={"file": (name, data, "application/octet-stream")})


@pytest.fixture
def admin(api: Api, team: Team) -> Api:
    return api.as_user(team.admin)


HOSTILE: dict[str, tuple[bytes, str]] = {
    "pax_header_huge": (pax_huge(4 * MiB), "header_too_large"),
    "pax_global_header_huge": (
        tar_gz(header("pax_global_header", tarfile.XGLTYPE, MiB), Fill(b"a", MiB), OK, END),
        "header_too_large",
    ),
    "gnu_long_name_huge": (gnu_long_huge(4 * MiB), "header_too_large"),
    "gnu_long_link_huge": (
        tar_gz(header("././@LongLink", tarfile.GNUTYPE_LONGLINK, MiB), Fill(b"a", MiB), OK),
        "header_too_large",
    ),
    "header_chain": (header_chain(2_000), "too_many_headers"),
    "sparse_pax_map": (sparse_map(MiB), "special_file"),
    "sparse_gnu_old": (gnu_sparse_chain(64 * BLOCK), "special_file"),
    "zip_folders": (zip_folders(5_000), "too_many_files"),
    "zip_directory_huge": (zip_commented(3, 60_000), "header_too_large"),
    "tar_folders": (tar_folders(5_000), "too_many_files"),
    # One file, nested 20 folders deep: the folders it makes count too.
    "implied_folders": (tar_gz(member("/".join("d" * 20) + "/f.py", b"x"), END), "too_many_files"),
    "tar_name_not_utf8": (tar_gz(member(NOT_UTF8, b"x = 1\n"), END), "not_utf8"),
    "pax_name_not_utf8": (
        tar_gz(member(NOT_UTF8, b"x = 1\n", tarfile.PAX_FORMAT), END),
        "not_utf8",
    ),
    "gnu_long_name_not_utf8": (
        tar_gz(member("pkg/" + "a" * 120 + "\udce9.py", b"x = 1\n"), END),
        "not_utf8",
    ),
    "zip_flagged_name_not_utf8": (zip_named(b"pkg/caf\xe9.py", utf8_flag=True), "not_utf8"),
    "zip_name_not_utf8": (zip_named(b"pkg/caf\xe9.py", utf8_flag=False), "not_utf8"),
    "name_too_long": (tar_gz(member("pkg/" + "a" * 300 + ".py", b"x"), END), "bad_name"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_archive_is_a_422_naming_its_rule(
    admin: Api, settings: Settings, kind: str
) -> None:
    settings.max_code_files = 10
    data, rule = HOSTILE[kind]
    r = upload(admin, data, "code.zip" if kind.startswith("zip") else "code.tar.gz")
    assert r.status_code == 422, r.text
    fields = r.json()["fields"]
    assert [(f["field"], f["rule"]) for f in fields] == [("file", rule)], fields
    root = settings.resolved_code_dir()
    assert not root.exists() or list(root.iterdir()) == []


def test_the_file_limit_counts_folders_and_reports_files(admin: Api, settings: Settings) -> None:
    # pkg/ and pkg/sub/ (named or implied) and three files: five entries.
    files = {"pkg/__init__.py": b"", "pkg/sub/a.py": b"a = 1\n", "pkg/sub/b.py": b"b = 2\n"}
    folders = b"".join(header(name, tarfile.DIRTYPE) for name in ("pkg", "pkg/sub"))
    archive = tar_gz(folders, *(member(n, d) for n, d in files.items()), END)
    settings.max_code_files = 4
    r = upload(admin, archive)
    assert r.status_code == 422 and r.json()["fields"][0]["rule"] == "too_many_files", r.text
    assert "files and folders" in r.json()["message"]
    settings.max_code_files = 5
    r = upload(admin, archive)
    assert r.status_code == 201, r.text
    assert r.json()["files"] == 3  # what is reported is still files


def test_names_within_the_header_bound_still_unpack(admin: Api) -> None:
    """GNU long names and PAX headers are how tar stores a path over 100 bytes: a long one,
    in either format, is accepted (the bound is far above any real path)."""
    deep = "pkg/" + "/".join(["abcdefghij" * 5] * 20) + "/m.py"  # about 1 KB
    digests = set()
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        r = upload(admin, tar_gz(member(deep, b"x = 1\n", fmt), END))
        assert r.status_code in (200, 201), r.text
        digests.add(r.json()["digest"])
    listing = admin.get(f"/v1/code/{digests.pop()}").json()["listing"]
    assert [f["path"] for f in listing] == [deep] and not digests


def test_a_zip_of_utf8_names_without_the_flag_is_the_same_bundle_as_the_tar(admin: Api) -> None:
    """Info-ZIP and others write UTF-8 names without setting the zip's UTF-8 flag: read as
    UTF-8 (not as the CP437 of old DOS), they name the same files as in a tarball."""
    name = "pkg/café.py"
    from_tar = upload(admin, tar_gz(member(name, b"x = 1\n"), END))
    from_zip = upload(admin, zip_named(name.encode(), utf8_flag=False), "code.zip")
    assert from_tar.status_code == 201, from_tar.text
    assert from_zip.status_code == 200, from_zip.text
    assert from_zip.json()["digest"] == from_tar.json()["digest"]


# --------------------------------------------------------------------------------------------
# What the API's process spends on them

BOUND_MB = 64


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


class PeakRss:
    """The highest resident set of a process while the block runs: the kernel's high-water
    mark (VmHWM, reset first through clear_refs) where it can be reset, and in any case a
    sampler reading VmRSS every 2 ms (a spike shorter than that is missed by the sampler,
    never by VmHWM)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.baseline_kb = 0
        self.peak_kb = 0
        self.kernel = False
        self._stop = threading.Event()

    def __enter__(self) -> PeakRss:
        self.baseline_kb = _status_kb(self.pid, "VmRSS")
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            self.kernel = True
        except OSError:
            self.kernel = False
        self.peak_kb = self.baseline_kb
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, _status_kb(self.pid, "VmRSS"))
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.kernel:
            self.peak_kb = max(self.peak_kb, _status_kb(self.pid, "VmHWM"))

    @property
    def growth_mb(self) -> float:
        return (self.peak_kb - self.baseline_kb) / 1024


@pytest.fixture(scope="module")
def memory_bombs() -> dict[str, tuple[bytes, str]]:
    """Each a few hundred KB on the wire (the zip, 18 MB), each made the API allocate
    hundreds of MB before it answered."""
    return {
        "pax_header_256MiB": (pax_huge(256 * MiB), "header_too_large"),
        "gnu_long_name_256MiB": (gnu_long_huge(256 * MiB), "header_too_large"),
        "sparse_pax_map_64MiB": (sparse_map(64 * MiB), "special_file"),
        "sparse_gnu_chain_64MiB": (gnu_sparse_chain(64 * MiB), "special_file"),
        "zip_200k_folders": (zip_folders(200_000), "too_many_files"),
        "zip_name_not_utf8": (zip_named(b"pkg/caf\xe9.py", utf8_flag=True), "not_utf8"),
        "tar_name_not_utf8": (tar_gz(member(NOT_UTF8, b"x = 1\n"), END), "not_utf8"),
    }


@pytest.fixture
def api_process(db_url: str, tmp_path: Path) -> Iterator[ApiProcess]:
    api = ApiProcess(db_url, tmp_path / "api", env={"HALFWAY_MAX_CODE_FILES": "10"})
    try:
        api.wait_ready()
        yield api
    finally:
        api.stop()


def test_hostile_archives_leave_the_api_process_within_tens_of_mb_of_its_baseline(
    api_process: ApiProcess, team: Team, memory_bombs: dict[str, tuple[bytes, str]]
) -> None:
    headers = Team.header(team.admin)

    def post(data: bytes, name: str) -> httpx.Response:
        files = {"file": (name, data, "application/octet-stream")}
        return httpx.post(f"{api_process.url}/v1/code", files=files, headers=headers, timeout=300)

    # Warm up what an upload imports and allocates once (multipart, tarfile, zipfile).
    assert post(tar_gz(OK, END), "code.tar.gz").status_code == 201
    assert post(zip_folders(0), "code.zip").status_code == 201
    seen: dict[str, tuple[int, str]] = {}
    with PeakRss(api_process.process.pid) as rss:
        for kind, (data, _rule) in memory_bombs.items():
            assert len(data) < (32 if kind.startswith("zip") else 2) * MiB, (kind, len(data))
            r = post(data, "code.zip" if kind.startswith("zip") else "code.tar.gz")
            rule = r.json().get("fields", [{}])[0].get("rule", "") if r.status_code == 422 else ""
            seen[kind] = (r.status_code, rule or r.text[:200])
    figures = (
        f"baseline {rss.baseline_kb / 1024:.0f} MB, peak {rss.peak_kb / 1024:.0f} MB "
        f"(+{rss.growth_mb:.1f} MB; kernel high-water mark: {rss.kernel})"
    )
    print(figures)
    assert seen == {kind: (422, rule) for kind, (_data, rule) in memory_bombs.items()}, figures
    assert rss.growth_mb < BOUND_MB, figures
