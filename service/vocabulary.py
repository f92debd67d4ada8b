"""The words the server, the workers, the client and the dashboard share, defined once.

This module imports nothing of Halfway's, so the light client package can use it too; the
dashboard reads the same lists from ``GET /v1/vocabulary``."""

from __future__ import annotations

from typing import Final, Literal

JOB_STATUSES: Final = ("queued", "running", "succeeded", "failed", "cancelled")
# A job in one of these never changes status again.
FINISHED_STATUSES: Final = ("succeeded", "failed", "cancelled")
# Why a queued job waits (GET /v1/queue, a job's ``queue``; docs/scheduling.md).
QueueReason = Literal["next", "priority", "share", "age", "per-user cap", "budget", "no slot"]
# Why the loss scale changed at a step (GET /v1/jobs/{id}/loss-scale/events).
SCALE_EVENT_REASONS: Final = ("overflow", "growth")
# A gradient sample's figures (GET /v1/jobs/{id}/gradients), in the order every answer lists
# them; each is a float, or null where it is undefined.
GRADIENT_FIGURES: Final = (
    "zero_share",
    "log2_max",
    "log2_min_nonzero",
    "headroom",
    "subnormal_share",
    "underflow_share",
    "lost_share",
    "relative_error",
)
# The ``variable`` of the long table's row (Arrow, Parquet) that holds the whole model's.
GRADIENT_MODEL_ROW: Final = "(model)"


def vocabulary() -> dict[str, list[str]]:
    return {
        "job_statuses": list(JOB_STATUSES),
        "finished_statuses": list(FINISHED_STATUSES),
        "scale_event_reasons": list(SCALE_EVENT_REASONS),
        "gradient_figures": list(GRADIENT_FIGURES),
    }
