"""Which GPUs this host has and how a worker splits them into supervisor slots. Detection uses
NVML (``pynvml``) when installed, else ``nvidia-smi``; never TensorFlow."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable


def detect_gpus() -> list[int]:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            return list(range(pynvml.nvmlDeviceGetCount()))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # not installed, or no driver
        pass
    out = nvidia_smi("--query-gpu=index", "--format=csv,noheader")
    return [] if out is None else [int(line) for line in out.split() if line.strip().isdigit()]


def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output, or None when there is no nvidia-smi (or no driver)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        return subprocess.run(
            [smi, *args], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return None


def parse_gpus(value: str | None) -> list[int]:
    """``None`` or '' -> CPU only; 'all' -> every detected GPU; '0,2' -> those ids."""
    if value is None or value.strip() == "":
        return []
    if value.strip().lower() == "all":
        found = detect_gpus()
        if not found:
            raise ValueError("'all' found no GPUs (no NVML, no nvidia-smi, or no driver)")
        return found
    ids = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"{part!r} is not a GPU index")
        ids.append(int(part))
    if len(set(ids)) != len(ids):
        raise ValueError("a GPU is listed twice")
    return ids


def slots(gpu_ids: list[int], per_slot: int) -> list[list[int]]:
    """Split the GPUs into supervisor slots of ``per_slot`` each; no GPUs means one CPU slot."""
    if per_slot < 1:
        raise ValueError("gpus per slot must be at least 1")
    if not gpu_ids:
        return [[]]
    if len(gpu_ids) % per_slot:
        raise ValueError(f"{len(gpu_ids)} GPUs do not split into slots of {per_slot}")
    return [gpu_ids[i : i + per_slot] for i in range(0, len(gpu_ids), per_slot)]


MemoryProbe = Callable[[list[int]], dict[int, int] | None]


def used_memory_mib(gpu_ids: list[int]) -> dict[int, int] | None:
    """MiB in use on each GPU, via nvidia-smi; None when it cannot tell (no tool, no driver)."""
    if not gpu_ids:
        return None
    out = nvidia_smi(
        "--query-gpu=index,memory.used",
        "--format=csv,noheader,nounits",
        "-i",
        ",".join(str(g) for g in gpu_ids),
    )
    if out is None:
        return None
    used = {}
    for line in out.strip().splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            used[int(index)] = int(mib)
    return used


def wait_until_free(
    gpu_ids: list[int],
    *,
    threshold_mib: int,
    timeout: float,
    probe: MemoryProbe = used_memory_mib,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Wait until every GPU of the slot uses at most ``threshold_mib`` (the driver frees a dead
    process's memory asynchronously). True when free or when nothing can be measured."""
    if not gpu_ids:
        return True
    waited = 0.0
    while True:
        used = probe(gpu_ids)
        if used is None or all(used.get(g, 0) <= threshold_mib for g in gpu_ids):
            return True
        if waited >= timeout:
            return False
        sleep(0.5)
        waited += 0.5
