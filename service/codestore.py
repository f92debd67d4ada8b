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
"""

from __future__ import annotations

import contextlib
import math
import os
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from service import code
from service.errors import Conflict, NotFound
from service.storage import Store

TAR_BLOCK = 512


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
    if legacy.is_dir() and code.tree_digest(legacy) == code.hex_of(digest):
        with _work(cache_dir, ".backfill-") as work:
            pack(legacy, work / "bundle.tar")
            store.put_file(key, work / "bundle.tar")
        return key
    raise NotFound(f"no code bundle {digest}; upload it with POST /v1/code")


def fetch(store: Store, cache_dir: Path, digest: str) -> Path:
    """The bundle's unpacked tree on this host: from the cache, or downloaded from the store,
    unpacked with every member checked, verified against its digest and then cached."""
    hexdigest = code.hex_of(digest)
    target = cache_dir / hexdigest
    if target.is_dir():
        return target
    key = key_for(digest)
    with _work(cache_dir, ".fetch-") as work:
        archive = work / "bundle.tar"
        if not store.get_file(key, archive):
            raise NotFound(f"no code bundle {digest} in the store ({store.url(key)})")
        tree = work / "tree"
        tree.mkdir()
        size = archive.stat().st_size
        try:
            # The object bounds what it can unpack to: at most its size, one file a block.
            code.unpack_tar(archive, tree, code.Limits(size, size // TAR_BLOCK + 1, math.inf))
        except code.BundleError as exc:
            raise BundleCorrupt(
                f"code bundle {digest}: the store's object {store.url(key)} is not a bundle "
                f"Halfway wrote ({exc.detail}); upload the bundle again"
            ) from None
        found = code.tree_digest(tree)
        if found != hexdigest:
            raise BundleCorrupt(
                f"code bundle {digest}: digest mismatch, the files of the store's object "
                f"{store.url(key)} hash to sha256:{found}; it was changed after it was "
                "uploaded: upload the bundle again"
            )
        _settle(tree, target)
    return target


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
        code.remove(work)


def _settle(tree: Path, target: Path) -> None:
    code.make_read_only(tree)
    try:
        os.rename(tree, target)
    except OSError:
        if not target.is_dir():
            raise
        # Another upload or job of the same bundle got there first: the same files.
