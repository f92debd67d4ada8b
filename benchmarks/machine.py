"""What the benchmarks print about the machine they ran on."""

from __future__ import annotations


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where it has none)."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"
