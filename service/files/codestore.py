"""Where code bundles live: one object per bundle in the code store (``sha256-<hex>.tar``, a
normalized tar of the checked tree), and on each host a cache of unpacked, read-only trees
(``HALFWAY_CODE_DIR/<hex>/``) that the API parses entry points in and training children put
on ``sys.path``.

One object, not the tree's files: a single PUT is atomic on every store (a renamed file, an
S3 PUT or completed multipart upload), so a half-written bundle is never visible and no
commit marker is needed, and a host fetches a bundle of thousands of files in one GET. The
tar is built the same way every time (paths sorted, no times, owners or modes of the
uploader's), so the same files give the same bytes and two uploads of a bundle, even
concurrent ones, write the same object. Uncompressed, because the object can then never
unpack to more than its own size (no bomb to guard against on fetch), and its member
headers can be listed with a few range reads.

A tree enters a cache only whole: it is unpacked in a temporary directory beside the cache,
checked against its digest, made read-only and renamed into place. Nothing here imports
the code.

Read-only bits are no lock against a job: it runs as the cache's own OS user and can unlock
a tree and change it for every later job of the bundle on the host. So a cached tree is
checked against its digest each time it is handed out, and so is everything a fetch never
leaves there (a link, a FIFO, a file or folder not read-only). A tree that fails is renamed
aside in one step, removed without following its links, and fetched again from the store.
Renames settle races between fetchers of one bundle: whoever renames a checked tree into
place first wins, and the others check what they find there like any cached tree.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import secrets
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from service.errors import Conflict, NotFound
from service.files import archives, code
from service.files.storage import Store

log = logging.getLogger("halfway.code")

TAR_BLOCK = 512
# What make_read_only leaves: any other mode on a cached tree means someone changed it.
FILE_MODE = 0o444
FOLDER_MODE = 0o555
# A fetch checks what sits in the cache, replaces it if it must, and checks again what it
# finds when another fetcher's rename beat its own: a few rounds, unless the cache keeps
# changing under it.
FETCH_ROUNDS = 4


class BundleCorrupt(Conflict):
    """The store's object is not the bundle its key names (changed or damaged after it was
    uploaded): uploading the bundle again writes it afresh."""


@dataclass(frozen=True)
class Bundle:
    digest: str
    files: int
    bytes: int
    created: bool  # False when the store held this bundle already


def key_for(digest: str) -> str:
    return f"sha256-{code.hex_of(digest)}.tar"


def upload(source: IO[bytes], store: Store, cache_dir: Path, limits: code.Limits) -> Bundle:
    """Check and unpack an uploaded archive, put its bundle in the store and its tree in this
    host's cache. The object is written before the tree enters the cache, so a store that
    fails leaves neither (a cached tree would let a job be accepted that no other host can
    run)."""
    with _work(cache_dir, ".upload-") as work:
        unpacked = code.unpack_upload(source, work, limits)
        digest = code.DIGEST_PREFIX + code.tree_digest(unpacked.tree)
        key = key_for(digest)
        existed = store.exists(key)
        # Written again when it exists: the same bytes, and an object damaged in the store
        # since is made whole by uploading the bundle once more.
        archive = work / "bundle.tar"
        pack(unpacked.tree, archive)
        store.put_file(key, archive)
        _settle(unpacked.tree, cache_dir / code.hex_of(digest))
        return Bundle(digest, unpacked.files, unpacked.bytes, created=not existed)


def find(store: Store, cache_dir: Path, digest: str) -> str:
    """The bundle's key in the store, or NotFound. A bundle uploaded before bundles lived in
    the store (only its tree, in this host's cache) is put there now."""
    key = key_for(digest)
    if store.exists(key):
        return key
    legacy = cache_dir / code.hex_of(digest)
    seen = _inspect(legacy, code.hex_of(digest))
    if seen is not None and seen.intact:
        with _work(cache_dir, ".backfill-") as work:
            pack(legacy, work / "bundle.tar")
            store.put_file(key, work / "bundle.tar")
        return key
    raise NotFound(f"no code bundle {digest}; upload it with POST /v1/code")


def fetch(store: Store, cache_dir: Path, digest: str) -> Path:
    """The bundle's unpacked tree on this host: from the cache once it is checked against its
    digest, or downloaded from the store, unpacked with every member checked, verified
    against its digest and then cached. A cached tree that fails its check is never handed
    out: it is removed and fetched again."""
    hexdigest = code.hex_of(digest)
    target = cache_dir / hexdigest
    for _ in range(FETCH_ROUNDS):
        seen = _inspect(target, hexdigest)
        if seen is not None and seen.intact:
            return target
        if seen is not None:
            log.warning(
                "code bundle %s: the cached tree %s does not match its digest (a file changed, "
                "added or removed, a link, or a mode not read-only); fetching it again",
                digest,
                target,
            )
            _discard(target, seen.identity)
        if _download(store, digest, target):
            return target
    raise Conflict(
        f"code bundle {digest}: the cached tree {target} kept changing while it was fetched "
        f"{FETCH_ROUNDS} times; something on this host is writing into the code cache"
    )


def _download(store: Store, digest: str, target: Path) -> bool:
    """Fetch the bundle from the store into ``target``; False if another tree was renamed
    there first (to be checked like any cached tree)."""
    key = key_for(digest)
    with _work(target.parent, ".fetch-") as work:
        archive = work / "bundle.tar"
        if not store.get_file(key, archive):
            raise NotFound(f"no code bundle {digest} in the store ({store.url(key)})")
        tree = work / "tree"
        tree.mkdir()
        size = archive.stat().st_size
        try:
            # The object bounds what it can unpack to: at most its size, one file a block.
            archives.unpack_tar(
                archive, tree, archives.Limits(size, size // TAR_BLOCK + 1, math.inf)
            )
        except archives.BundleError as exc:
            raise BundleCorrupt(
                f"code bundle {digest}: the store's object {store.url(key)} is not a bundle "
                f"Halfway wrote ({exc.detail}); upload the bundle again"
            ) from None
        found = code.tree_digest(tree)
        if found != code.hex_of(digest):
            raise BundleCorrupt(
                f"code bundle {digest}: digest mismatch, the files of the store's object "
                f"{store.url(key)} hash to sha256:{found}; it was changed after it was "
                "uploaded: upload the bundle again"
            )
        return _settle(tree, target)


def local_tree(store: Store, cache_dir: Path, digest: str) -> Path:
    """The tree of a bundle that is in the store (the API's view: a job is only accepted for
    a bundle every worker can fetch)."""
    find(store, cache_dir, digest)
    return fetch(store, cache_dir, digest)


def listing(store: Store, cache_dir: Path, digest: str) -> list[tuple[str, int]]:
    """Each file's path and size, from the store's object (its member headers only)."""
    key = find(store, cache_dir, digest)
    out = []
    try:
        with store.open_reader(key) as reader, tarfile.open(fileobj=reader, mode="r:") as tar:
            while (info := tar.next()) is not None:
                if info.isreg():
                    out.append((info.name, info.size))
    except (tarfile.TarError, EOFError) as exc:
        raise BundleCorrupt(
            f"code bundle {digest}: the store's object {store.url(key)} is not a readable tar "
            f"({exc}); upload the bundle again"
        ) from None
    return out


def pack(tree: Path, path: Path) -> None:
    """The normalized tar of a tree: its files in path order, read-only, owned by nobody,
    dated zero (the same files always give the same bytes)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in code.files(tree):
            info = tarfile.TarInfo(name)
            info.size = (tree / name).stat().st_size
            info.mode = 0o444
            with open(tree / name, "rb") as f:
                tar.addfile(info, f)


@contextlib.contextmanager
def _work(cache_dir: Path, prefix: str) -> Iterator[Path]:
    """A temporary directory beside the cache (the same file system, so a tree can be
    renamed into it), removed whatever happens. Its dotted name is never a digest."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=cache_dir, prefix=prefix))
    try:
        yield work
    finally:
        _remove(work)


def _settle(tree: Path, target: Path) -> bool:
    """Put a checked tree in the cache, read-only; False if something was there first (most
    often another fetcher's tree; whatever it is, a fetch checks it like any cached tree)."""
    # Moving a folder to another parent rewrites its '..', which takes write permission on
    # it (for anyone but root): the tree moves beside the target while still writable, and
    # is locked before the last rename, so the cache never holds an unlocked tree.
    beside = target.parent / f".settle-{secrets.token_hex(8)}"
    os.rename(tree, beside)
    try:
        code.make_read_only(beside)
        try:
            os.rename(beside, target)
        except OSError:
            if not os.path.lexists(target):
                raise
            return False
        return True
    finally:
        _remove(beside)


@dataclass(frozen=True)
class _Seen:
    """What sat at a cache path when it was checked."""

    identity: tuple[int, int]  # st_dev, st_ino
    intact: bool


def _inspect(target: Path, hexdigest: str) -> _Seen | None:
    """Whether the tree at ``target`` is the bundle's, untouched; None if nothing is there."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return None
    identity = (st.st_dev, st.st_ino)
    try:
        found = _checked_digest(target)
    except (OSError, UnicodeError):  # unreadable, changing under us, a name not UTF-8
        found = None
    return _Seen(identity, found == hexdigest)


def _checked_digest(root: Path) -> str | None:
    """``code.tree_digest`` of a cached tree (the same lines, in the same order), or None if
    the tree holds anything a fetch never leaves there: a link (the digest would read
    through one to a file, and not see one to a folder at all), a special file (reading a
    FIFO blocks), or a mode other than read-only (someone unlocked it)."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) != FOLDER_MODE:
        return None
    found: list[str] = []
    folders = [""]
    while folders:
        folder = folders.pop()
        with os.scandir(root / folder) as entries:
            for entry in entries:
                mode = entry.stat(follow_symlinks=False).st_mode
                name = f"{folder}/{entry.name}" if folder else entry.name
                if stat.S_ISDIR(mode) and stat.S_IMODE(mode) == FOLDER_MODE:
                    folders.append(name)
                elif stat.S_ISREG(mode) and stat.S_IMODE(mode) == FILE_MODE:
                    found.append(name)
                else:
                    return None
    outer = hashlib.sha256()
    for name in sorted(found):
        # No link followed, no wait on a FIFO swapped in since the walk: checked once open.
        fd = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) != FILE_MODE:
                return None
            inner = hashlib.sha256()
            size = 0
            while chunk := f.read(archives.CHUNK):
                inner.update(chunk)
                size += len(chunk)
        outer.update(f"{name}\0{size}\0{inner.hexdigest()}\n".encode())
    return outer.hexdigest()


def _discard(target: Path, identity: tuple[int, int]) -> None:
    """Take a tree that failed its check out of the cache. Renamed aside first, in one step
    and within its folder (no write permission on it needed); if what was renamed is not
    what was checked (another fetch settled a good tree there meanwhile), it goes back."""
    aside = target.parent / f".discard-{secrets.token_hex(8)}"
    try:
        os.rename(target, aside)
    except FileNotFoundError:
        return  # another fetch took it away first
    st = os.lstat(aside)
    if (st.st_dev, st.st_ino) != identity:
        with contextlib.suppress(OSError):  # a third tree is there already: ours goes
            os.rename(aside, target)
    _remove(aside)


def _remove(path: Path) -> None:
    """Remove a file or a tree that may have been tampered with: each folder is made
    writable first (a read-only folder cannot be emptied), without following a link out of
    the tree (``code.remove`` would chmod a linked folder wherever it points)."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    os.chmod(path, 0o700)
    # Top-down: each folder is unlocked before the walk lists it; links are listed as
    # folders but never entered, and never chmodded.
    for dirpath, dirs, _names in os.walk(path):
        for name in dirs:
            sub = os.path.join(dirpath, name)
            if not os.path.islink(sub):
                os.chmod(sub, 0o700)
    shutil.rmtree(path)
