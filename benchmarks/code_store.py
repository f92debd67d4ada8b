"""What keeping code bundles in the store costs, measured on this machine: for the example
bundle (examples/own-code/bundle) and a larger one (2,000 files, 20 MB), on a ``file://``
store and on an S3 API (moto's server on loopback, in its own process):

- the upload as ``POST /v1/code`` does it (check and unpack, digest, normalized tar, put,
  rename into the cache), beside the check-unpack-digest part alone (what main did);
- a training child's cold fetch (download, unpack with every member checked, digest, rename
  into the cache) and a warm one (the host's cache already holds the tree).

    .venv/bin/python benchmarks/code_store.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results
from storage_and_launch import moto

from service.client import codepack
from service.files import code, codestore
from service.files.storage import FileStore, S3Store, Store, s3_client

ROOT = Path(__file__).resolve().parent.parent
LIMITS = (50 * 1024**2, 10_000, 100.0)


def large_bundle(root: Path) -> Path:
    for i in range(2000):
        path = root / f"pkg{i % 20}" / f"m{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        # Half random (incompressible), half text, so the ratio stays like source code's.
        path.write_bytes(os.urandom(5000) + b"x = 1\n" * 833)
    return root


def interleaved(cases: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each case once per round, in turn, so the machine's load falls on all of them alike."""
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            started = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - started)
    return out


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s [{min(values):.3f}..{max(values):.3f}]"


def fresh(tmp: Path, prefix: str) -> Path:
    return tmp / f"{prefix}-{uuid.uuid4().hex[:8]}"


def check_only(archive: bytes, tmp: Path, limits: code.Limits) -> None:
    work = Path(tempfile.mkdtemp(dir=tmp))
    try:
        code.tree_digest(code.unpack_upload(io.BytesIO(archive), work, limits).tree)
    finally:
        code.remove(work)


def upload(archive: bytes, store: Store, tmp: Path, limits: code.Limits) -> str:
    return codestore.upload(io.BytesIO(archive), store, fresh(tmp, "api"), limits).digest


def cold_fetch(store: Store, tmp: Path, digest: str) -> None:
    codestore.fetch(store, fresh(tmp, "host"), digest)  # a host that never had it


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    limits = code.Limits(*LIMITS)
    proc, endpoint = moto()
    try:
        client = s3_client(endpoint, "us-east-1")
        client.create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            bundles = {
                "example": ROOT / "examples" / "own-code" / "bundle",
                "2,000 files, 20 MB": large_bundle(tmp / "large"),
            }
            stores: dict[str, Store] = {
                "file://": FileStore(tmp / "store"),
                "S3 (moto)": S3Store(client, "bench", "team/code"),
            }
            for label, folder in bundles.items():
                archive = codepack.pack(folder)
                digest = upload(archive, stores["file://"], tmp, limits)
                upload(archive, stores["S3 (moto)"], tmp, limits)
                warm_cache = fresh(tmp, "warm")
                codestore.fetch(stores["file://"], warm_cache, digest)
                cases: dict[str, Callable[[], object]] = {
                    "check, unpack, digest (main's upload)": partial(
                        check_only, archive, tmp, limits
                    ),
                    "warm fetch (the host's cache)": partial(
                        codestore.fetch, stores["file://"], warm_cache, digest
                    ),
                }
                for name, store in stores.items():
                    cases[f"upload, {name}"] = partial(upload, archive, store, tmp, limits)
                    cases[f"cold fetch, {name}"] = partial(cold_fetch, store, tmp, digest)
                print(f"{label}: archive {len(archive) / 1024:.0f} KiB, median [min..max]")
                for name, times in interleaved(cases, rounds).items():
                    print(f"  {name}: {fmt(times)}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    results.run(main)
