"""What several hosts cost, measured on this machine:

- committing a checkpoint to an S3 API (moto's server on loopback, in its own process) and
  to a local directory: the example model's real checkpoint (examples/classic.json: weights,
  Adam's slots and the loss scaler's state) and a 100 MB one; upload, digest and marker
  (what isolation adds to it, against the child writing in place: benchmarks/isolation.py);
- what the Ray launcher adds to a job's start: from ``launcher.start`` to the child's
  ``started`` message (TensorFlow imported, data built, model compiled) and to its first
  records, local spawn against a Ray actor on a loopback cluster (a head and one node).

    .venv/bin/python benchmarks/storage_and_launch.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import results

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def moto() -> tuple[subprocess.Popen[bytes], str]:
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    port = free_port()
    server = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            httpx.get(endpoint + "/moto-api/", timeout=1)
            return proc, endpoint
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("moto_server did not start")


def example_spec(tmp: Path) -> dict[str, Any]:
    from service.settings import Settings
    from service.specs.normalization import normalize
    from service.specs.schemas import JobSpec

    body = json.loads((ROOT / "examples" / "classic.json").read_text())
    spec: dict[str, Any] = normalize(
        JobSpec.model_validate(body), Settings(home=tmp)
    ).spec.model_dump(mode="json")
    return spec


def example_checkpoint(tmp: Path) -> Path:
    """The example model's checkpoint as the training child writes it."""
    from workers.checkpointer import Checkpointer
    from workers.trainer import build_trainer

    spec = example_spec(tmp)
    built = build_trainer(spec, (784,), 10, 64)
    folder = tmp / "example"
    folder.mkdir()
    Checkpointer(folder).save(built.trainer, 100)
    return folder / "checkpoint-000000000100.npz"


def time_commit(store: Any, local: Path, rounds: int) -> list[float]:
    from workers import checkpoints

    out = []
    for i in range(rounds):
        started = time.perf_counter()
        with open(local, "rb") as f:
            checkpoints.commit(store, f"bench-{uuid.uuid4().hex[:6]}", 100 + i, f)
        out.append(time.perf_counter() - started)
    return out


def fmt(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} s [{min(values):.3f}..{max(values):.3f}]"


def bench_checkpoints(rounds: int) -> None:
    from service.files.storage import FileStore, S3Store, s3_client

    proc, endpoint = moto()
    try:
        client = s3_client(endpoint, "us-east-1")
        client.create_bucket(Bucket="bench")
        s3 = S3Store(client, "bench", "team/artifacts")
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            example = example_checkpoint(tmp_path)
            big = tmp_path / "big" / "checkpoint-000000000100.npz"
            big.parent.mkdir()
            big.write_bytes(os.urandom(100 * 1024**2))
            local = FileStore(tmp_path / "local-store")
            for name, path in (("example model", example), ("100 MB", big)):
                size = path.stat().st_size / 1024**2
                print(f"checkpoint {name} ({size:.2f} MiB)")
                print(f"  S3 (moto, loopback): {fmt(time_commit(s3, path, rounds))}")
                print(f"  file:// (a copy):    {fmt(time_commit(local, path, rounds))}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bench_launch(rounds: int) -> None:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # stay on loopback
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    from ray.cluster_utils import Cluster

    from service.files.storage import StorageConfig
    from workers import child, sandbox
    from workers.launchers import Launcher, LocalLauncher
    from workers.ray_launcher import RayLauncher

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 80 * 1024**2,
            "include_dashboard": False,
            "node_ip_address": "127.0.0.1",
        },
    )
    cluster.add_node(num_cpus=1, object_store_memory=80 * 1024**2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    launchers: dict[str, Launcher] = {
        "local": LocalLauncher(sandbox.resolve("auto")),
        "ray": RayLauncher(cluster.address),
    }
    results: dict[str, dict[str, list[float]]] = {
        k: {"started": [], "first steps": []} for k in launchers
    }
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            spec = example_spec(tmp_path)
            spec["training"]["epochs"] = 1
            spec["data"]["samples"] = 2048
            spec["outputs"]["save_model"] = False
            for i in range(rounds):
                for name, launcher in launchers.items():
                    payload = {
                        "job_id": 1000 + i,
                        "attempt": 1,
                        "spec": spec,
                        "storage": StorageConfig(
                            url=None,
                            artifact_dir=str(tmp_path / "artifacts"),
                            data_dir=str(tmp_path / "data"),
                            code_dir=str(tmp_path / "code"),
                        ).to_dict(),
                        "scratch_dir": str(tmp_path / "scratch"),
                        "code_dir": str(tmp_path / "code"),
                        "isolation": "auto",
                        "gpu_ids": [],
                        "flush_seconds": 0.1,
                        "resume_step": None,
                        "max_parameters": None,
                    }
                    started = time.perf_counter()
                    handle = launcher.start(child.run, payload, name="bench", gpus=0)
                    seen: dict[str, float] = {}
                    while not handle.finished():
                        for msg in handle.poll(0.05):
                            now = time.perf_counter() - started
                            if msg["type"] == "started":
                                seen.setdefault("started", now)
                            if msg["type"] == "steps":
                                seen.setdefault("first steps", now)
                    handle.close()
                    for key, value in seen.items():
                        results[name][key].append(value)
        for key in ("started", "first steps"):
            here, there = results["local"][key], results["ray"][key]
            print(f"start to {key}: local {fmt(here)}; ray {fmt(there)}")
            added = statistics.median(there) - statistics.median(here)
            print(f"  Ray adds {added:+.2f} s (median)")
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["checkpoints", "launch"], default=None)
    args = parser.parse_args()
    if args.only in (None, "checkpoints"):
        bench_checkpoints(args.rounds)
    if args.only in (None, "launch"):
        bench_launch(args.rounds)


if __name__ == "__main__":
    results.run(main)
