"""What a training child sets up before it builds anything: the devices it sees (and, to
rehearse multi-device training on a CPU, logical ones), the distribution strategy, what the
hardware means for the job's precision, and grappler's mixed-precision graph rewrite."""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.util import _pywrap_util_port

from workers.context import RunContext
from workers.cpu import CpuPrecision, compute_16bit, cpu_warnings


def configure_devices(ctx: RunContext) -> dict[str, Any]:
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        # Take memory as needed rather than all of it, so a job's footprint is its own.
        tf.config.experimental.set_memory_growth(gpu, True)
    info: dict[str, Any] = {"gpus": [g.name for g in gpus], "warnings": []}
    # Whether TensorFlow's CPU kernels go through oneDNN, as TensorFlow itself reports it: the
    # launcher turns it off for a float16 job on some CPUs (workers.cpu.tensorflow_env).
    info["onednn"] = bool(_pywrap_util_port.IsMklEnabled())
    for gpu in gpus:
        details = tf.config.experimental.get_device_details(gpu)
        cc = details.get("compute_capability")
        info.setdefault("compute_capability", []).append(cc)
        info.setdefault("device_names", []).append(details.get("device_name"))
    policy = ctx.spec["precision"]["policy"]
    info["warnings"] = hardware_warnings(
        policy, info.get("compute_capability", []), bool(ctx.spec["precision"]["graph_rewrite"])
    )
    replicas = int(ctx.spec.get("resources", {}).get("cpu_replicas", 1))
    if not gpus and replicas > 1:
        # Rehearse multi-device training on a CPU: split it into logical devices. This must
        # happen before TensorFlow creates its runtime, i.e. first thing in the child.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)]
        )
    return info


def make_strategy() -> tf.distribute.Strategy | None:
    """MirroredStrategy over the visible GPUs when there are several (the slot's GPUs), or
    over logical CPU devices when the job rehearses that; None for one device."""
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) > 1:
        return tf.distribute.MirroredStrategy([g.name for g in gpus])
    cpus = tf.config.list_logical_devices("CPU")
    if not gpus and len(cpus) > 1:
        return tf.distribute.MirroredStrategy([c.name for c in cpus])
    return None


def hardware_warnings(
    policy: str,
    capabilities: list[tuple[int, int] | None],
    graph_rewrite: bool = False,
    cpu: CpuPrecision | None = None,
) -> list[str]:
    """bfloat16 needs compute capability 8.0 and float16 Tensor Cores 7.0 to be fast; on a CPU,
    what the precision settings do depends on its instructions (workers/cpu.py)."""
    if not capabilities:
        return cpu_warnings(policy, graph_rewrite, cpu or CpuPrecision.detect())
    warnings: list[str] = []
    compute = compute_16bit(policy)
    if compute is None:
        return warnings
    need = (8, 0) if compute == "bfloat16" else (7, 0)
    for i, cc in enumerate(capabilities):
        if cc is not None and tuple(cc) < need:
            warnings.append(
                f"GPU {i} has compute capability {cc[0]}.{cc[1]}; {compute} needs "
                f"{need[0]}.{need[1]} or newer to be fast, so {policy} may be slower than "
                "float32 here."
            )
    return warnings


def configure_graph_rewrite(enabled: bool) -> str | None:
    if not enabled:
        return None
    option = (
        "auto_mixed_precision"
        if tf.config.list_physical_devices("GPU")
        else "auto_mixed_precision_onednn_bfloat16"
    )
    tf.config.optimizer.set_experimental_options({option: True})
    return option
