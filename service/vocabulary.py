"""The words the server, the workers, the client and the dashboard share, defined once.

This module imports nothing of Halfway's, so the light client package can use it too; the
dashboard reads the same lists from ``GET /v1/vocabulary``."""

from __future__ import annotations

from typing import Final

JOB_STATUSES: Final = ("queued", "running", "succeeded", "failed", "cancelled")
# A job in one of these never changes status again.
FINISHED_STATUSES: Final = ("succeeded", "failed", "cancelled")
# Why the loss scale changed at a step (GET /v1/jobs/{id}/loss-scale/events).
SCALE_EVENT_REASONS: Final = ("overflow", "growth")


def vocabulary() -> dict[str, list[str]]:
    return {
        "job_statuses": list(JOB_STATUSES),
        "finished_statuses": list(FINISHED_STATUSES),
        "scale_event_reasons": list(SCALE_EVENT_REASONS),
    }
