"""A training step's record, the row every writer and reader of the history shares: the
training child's stream, the supervisor's flush, the PostgreSQL append paths and the
queries. Its own module, beneath all of them, so none imports another for it."""

from __future__ import annotations

from typing import NamedTuple


class StepRecord(NamedTuple):
    step: int
    epoch: int
    loss: float
    loss_scale: float
    finite: bool
