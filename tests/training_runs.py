"""Running ``workers.training.train`` in the test process: specs built through the real
pydantic schema and normalization, so the child sees exactly what the API would hand it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.settings import Settings
from service.specs.normalization import normalize
from service.specs.schemas import JobSpec
from workers.context import RunContext
from workers.protocol import JobError, Message
from workers.training import train

Record = tuple[int, int, float, float, bool]

# 23 full batches of 16: with steps_per_execution=5 every epoch ends on a partial execution.
TINY: dict[str, dict[str, Any]] = {
    "data": {"kind": "synthetic", "samples": 23 * 16, "features": 8, "classes": 3},
    "model": {"input_size": 8, "hidden": [8], "num_classes": 3},
    "training": {"epochs": 2, "batch_size": 16, "steps_per_execution": 5},
    "outputs": {"save_model": False},
}


def job_spec(tmp_path: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """TINY with ``sections`` merged in (field by field), validated and normalized."""
    body: dict[str, Any] = {k: dict(v) for k, v in TINY.items()}
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value}
    result = normalize(JobSpec.model_validate(body), Settings(home=tmp_path / "home"))
    spec: dict[str, Any] = result.spec.model_dump(mode="json")
    return spec


@dataclass
class Run:
    status: str | None
    error: str | None
    messages: list[Message] = field(default_factory=list)

    @property
    def records(self) -> list[Record]:
        out: list[Record] = []
        for m in self.messages:
            if m["type"] == "steps":
                out += m["records"]
        return out

    @property
    def steps(self) -> list[int]:
        return [r[0] for r in self.records]

    def of_type(self, kind: str) -> list[Message]:
        return [m for m in self.messages if m["type"] == kind]

    @property
    def started(self) -> dict[str, Any]:
        (msg,) = self.of_type("started")
        return dict(msg)


def run_job(
    spec: dict[str, Any],
    job_dir: Path,
    *,
    stop_after_step: int | None = None,
    resume_step: int | None = None,
) -> Run:
    """Train in this process. ``stop_after_step`` sets the stop event (what SIGTERM does in
    the child) once the records sent so far reach that step; the run then stops at the end
    of the execution in flight, like a real cancel."""
    stop = threading.Event()
    run = Run(status=None, error=None)

    def emit(message: Message) -> None:
        run.messages.append(message)
        if (
            stop_after_step is not None
            and message["type"] == "steps"
            and message["records"][-1][0] >= stop_after_step
        ):
            stop.set()

    ctx = RunContext(
        job_id=1,
        spec=spec,
        job_dir=job_dir,
        data_dir=job_dir.parent,
        emit=emit,
        stop=stop,
        # Every execution's records are sent at once, so a test sees them in step order
        # and the stop above lands on a known execution.
        flush_seconds=0.0,
        resume_step=resume_step,
    )
    try:
        run.status = train(ctx)
    except JobError as exc:
        run.error = str(exc)
    return run
