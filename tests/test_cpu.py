"""What a CPU can do for 16-bit arithmetic, and what a CPU job is told about it."""

from __future__ import annotations

import pytest

from workers.cpu import CpuPrecision, cpu_flags, cpu_warnings, tensorflow_env

AMD_ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
SKYLAKE_SP = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512vl\n"
SAPPHIRE = "flags\t\t: avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd asimdhp sve bf16 i8mm\n"


def test_flags_are_read_from_the_first_cpu_of_x86_and_arm_cpuinfo() -> None:
    assert cpu_flags(AMD_ZEN3) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert "bf16" in cpu_flags(GRAVITON3)
    assert cpu_flags("processor: 0\n") == frozenset()


@pytest.mark.parametrize(
    ("cpuinfo", "machine", "expected"),
    [
        (AMD_ZEN3, "x86_64", CpuPrecision(False, False, False)),
        (SKYLAKE_SP, "x86_64", CpuPrecision(False, False, True)),
        (SAPPHIRE, "x86_64", CpuPrecision(True, True, True)),
        (GRAVITON3, "aarch64", CpuPrecision(True, True, False)),
    ],
)
def test_precision_facts_follow_the_instructions(
    cpuinfo: str, machine: str, expected: CpuPrecision
) -> None:
    assert CpuPrecision.from_flags(cpu_flags(cpuinfo), machine) == expected


def test_bfloat16_is_called_emulated_only_without_bfloat16_instructions() -> None:
    amd = CpuPrecision.from_flags(cpu_flags(AMD_ZEN3), "x86_64")
    spr = CpuPrecision.from_flags(cpu_flags(SAPPHIRE), "x86_64")
    [warning] = cpu_warnings("mixed_bfloat16", False, amd)
    assert "emulated" in warning and "AVX512-BF16" in warning
    assert cpu_warnings("mixed_bfloat16", False, spr) == []
    assert cpu_warnings("float32", False, amd) == []


def test_float16_on_a_cpu_is_always_flagged_and_says_which_instructions_it_has() -> None:
    amd = CpuPrecision.from_flags(cpu_flags(AMD_ZEN3), "x86_64")
    spr = CpuPrecision.from_flags(cpu_flags(SAPPHIRE), "x86_64")
    [on_amd] = cpu_warnings("mixed_float16", False, amd)
    [on_spr] = cpu_warnings("mixed_float16", False, spr)
    assert "no float16 instructions" in on_amd and "emulated" in on_amd
    assert "has float16 instructions" in on_spr


def test_the_graph_rewrite_is_called_a_no_op_emulated_or_nothing_by_the_cpu() -> None:
    amd, skx, spr = (
        CpuPrecision.from_flags(cpu_flags(text), "x86_64")
        for text in (AMD_ZEN3, SKYLAKE_SP, SAPPHIRE)
    )
    [noop] = cpu_warnings("float32", True, amd)
    assert "no-op" in noop and "float32" in noop
    [emulated] = cpu_warnings("float32", True, skx)
    assert "emulated" in emulated and "no-op" not in emulated
    assert cpu_warnings("float32", True, spr) == []
    assert cpu_warnings("float32", False, amd) == []


@pytest.mark.parametrize("policy", ["mixed_float16", "float16"])
def test_a_float16_job_runs_without_onednn_only_on_a_cpu_with_float16_instructions(
    policy: str,
) -> None:
    spr = CpuPrecision.from_flags(cpu_flags(SAPPHIRE), "x86_64")
    amd = CpuPrecision.from_flags(cpu_flags(AMD_ZEN3), "x86_64")
    assert tensorflow_env(policy, spr, {}) == {"TF_ENABLE_ONEDNN_OPTS": "0"}
    assert tensorflow_env(policy, amd, {}) == {}
    # The worker's own setting passes to the child as it is (sandbox.child_env's allow-list).
    assert tensorflow_env(policy, spr, {"TF_ENABLE_ONEDNN_OPTS": "1"}) == {}


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "bfloat16", "auto"])
def test_other_policies_keep_onednn_on_every_cpu(policy: str) -> None:
    spr = CpuPrecision.from_flags(cpu_flags(SAPPHIRE), "x86_64")
    assert tensorflow_env(policy, spr, {}) == {}
