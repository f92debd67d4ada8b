"""What this CPU can do for 16-bit arithmetic, read from /proc/cpuinfo (no TensorFlow).

Three facts decide what a CPU job's precision settings really do:

- native bfloat16 (AVX512-BF16 or AMX-BF16 on x86, BF16 on Arm): oneDNN runs bfloat16 matmuls
  in hardware; without it bfloat16 is emulated (still bfloat16 results, usually slower);
- native float16 (AVX512-FP16 or AMX-FP16 on x86, half-precision SIMD on Arm);
- the oneDNN bfloat16 graph rewrite (grappler's ``auto_mixed_precision_onednn_bfloat16``):
  TensorFlow applies it only where it deems oneDNN bfloat16 usable, AVX-512F or AVX-NE-CONVERT
  (``IsBF16SupportedByOneDNNOnThisCPU``); elsewhere it leaves the graph in float32, so the job
  trains exactly as float32 does.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from service.specs.policies import POLICIES

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of the first CPU ("flags" on x86, "Features" on Arm)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@dataclass(frozen=True)
class CpuPrecision:
    bfloat16_native: bool
    float16_native: bool
    onednn_bfloat16_rewrite: bool

    @classmethod
    def from_flags(cls, flags: frozenset[str], machine: str | None = None) -> CpuPrecision:
        arm = (machine or platform.machine()).lower() in ("aarch64", "arm64")
        if arm:
            return cls(
                bfloat16_native="bf16" in flags,
                float16_native="asimdhp" in flags,
                # TensorFlow's Arm builds gate the rewrite differently; we only claim x86's rule.
                onednn_bfloat16_rewrite=False,
            )
        return cls(
            bfloat16_native=bool(flags & {"avx512_bf16", "amx_bf16"}),
            float16_native=bool(flags & {"avx512_fp16", "amx_fp16"}),
            onednn_bfloat16_rewrite=bool(flags & {"avx512f", "avx_ne_convert"}),
        )

    @classmethod
    def detect(cls) -> CpuPrecision:
        return cls.from_flags(cpu_flags())


def compute_16bit(policy: str) -> str | None:
    """The 16-bit type a Keras policy name computes in ("float16", "bfloat16"), else None
    (float32, float64, "auto"), as the policy table says."""
    facts = POLICIES.get(policy)
    dtype = facts.compute_dtype if facts is not None else None
    return dtype if dtype in ("float16", "bfloat16") else None


def tensorflow_env(policy: str, cpu: CpuPrecision, source: Mapping[str, str]) -> dict[str, str]:
    """TensorFlow settings for a CPU job's child, which must be in its environment before it
    imports TensorFlow. On a CPU with float16 instructions TensorFlow hands float16 ops to
    oneDNN, whose float16 kernels there are the slow ones: a fused MatMul+BiasAdd or a
    convolution's gradient ran a hundred times slower than in float32, and a mixed_float16
    MLP trained 25 to 30 times slower than float32 (``benchmarks/float16_cpu.py``), while
    TensorFlow's own float16 kernels keep float32's pace. So a job computing in float16 runs
    with oneDNN off; float32 and bfloat16 keep it (it is what makes them fast), and so does an
    ``auto`` job, which probes all three in one process. A worker that sets
    TF_ENABLE_ONEDNN_OPTS itself has the last word."""
    float16 = compute_16bit(policy) == "float16" and cpu.float16_native
    if float16 and "TF_ENABLE_ONEDNN_OPTS" not in source:
        return {"TF_ENABLE_ONEDNN_OPTS": "0"}
    return {}


def cpu_warnings(policy: str, graph_rewrite: bool, cpu: CpuPrecision) -> list[str]:
    """What a job on this CPU should be told about its precision settings."""
    warnings: list[str] = []
    compute = compute_16bit(policy)
    if compute == "float16":
        have = (
            "has float16 instructions (AVX512-FP16/AMX-FP16)"
            if cpu.float16_native
            else "has no float16 instructions (AVX512-FP16/AMX-FP16), so float16 arithmetic is "
            "emulated"
        )
        warnings.append(
            f"{policy} on the CPU: this CPU {have}; TensorFlow's CPU kernels are usually slower "
            "in float16 than in float32. It is here for rehearsal and correctness, not speed."
        )
    elif compute == "bfloat16" and not cpu.bfloat16_native:
        warnings.append(
            f"{policy} on the CPU: this CPU has no bfloat16 instructions (AVX512-BF16/AMX-BF16), "
            "so bfloat16 arithmetic is emulated and usually slower than float32. It is here for "
            "rehearsal and correctness, not speed."
        )
    if graph_rewrite:
        if not cpu.onednn_bfloat16_rewrite:
            warnings.append(
                "graph_rewrite on this CPU is a no-op: TensorFlow applies the oneDNN bfloat16 "
                "rewrite only on CPUs with AVX-512F or AVX-NE-CONVERT, so this job trains in "
                "plain float32."
            )
        elif not cpu.bfloat16_native:
            warnings.append(
                "graph_rewrite on this CPU: the oneDNN bfloat16 rewrite applies, but without "
                "bfloat16 instructions (AVX512-BF16/AMX-BF16) it is emulated and usually slower "
                "than float32."
            )
    return warnings
