"""The supervisor with fake trainers: real spawned processes speaking the child protocol, so
these tests cover claiming, history writes, cancel, crashes, retries and hangs without
TensorFlow."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from service.database.db import Database
from service.database.models import Job, Step, utcnow
from service.scheduling import jobs
from service.settings import Settings
from service.specs.schemas import JobSpec, SubmitResult
from tests import fakes
from workers.supervisor import Supervisor


def make_job(db: Database, fake: dict[str, Any], **spec: Any) -> int:
    submitted = SubmitResult(spec=JobSpec.model_validate(spec), warnings=[], notes=[])
    with db.write() as s:
        job = jobs.create_job(s, owner="alice", submitted=submitted, now=utcnow())
        job.spec = {**job.spec, "fake": fake}
        return job.id


def load(db: Database, job_id: int) -> Job:
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job


def step_count(db: Database, job_id: int) -> int:
    with db.read() as s:
        return int(s.scalar(select(func.count()).where(Step.job_id == job_id)) or 0)


@pytest.fixture
def supervisor(db: Database, settings: Settings) -> Supervisor:
    return Supervisor(db, settings, trainer=fakes.trainer, worker_id="test-worker")


@pytest.fixture
def background(supervisor: Supervisor) -> Iterator[Supervisor]:
    thread = threading.Thread(target=supervisor.run_forever, daemon=True)
    thread.start()
    yield supervisor
    supervisor.stop()
    thread.join(timeout=30)


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_successful_job_writes_every_step_and_the_summary(
    db: Database, supervisor: Supervisor
) -> None:
    job_id = make_job(db, {"steps": 37, "batch": 5})
    assert supervisor.run_once() is True
    job = load(db, job_id)
    assert job.status == "succeeded", job.error
    assert job.attempt == 1 and job.finished_at is not None
    assert step_count(db, job_id) == 37
    assert job.last_step == 36 and job.total_steps == 37
    assert job.loss_scale == 1024.0
    assert job.metrics["last_epoch"]["loss"] == 0.5
    assert supervisor.run_once() is False  # queue empty


def test_child_killed_by_signal_fails_with_that_reason_after_its_attempts(
    db: Database, supervisor: Supervisor
) -> None:
    job_id = make_job(db, {"mode": "sigkill_self"}, max_attempts=2)
    supervisor.run_once()
    job = load(db, job_id)
    assert job.status == "queued" and job.attempt == 1  # retried
    supervisor.run_once()
    job = load(db, job_id)
    assert job.status == "failed"
    assert "killed by signal 9 (SIGKILL)" in (job.error or "")
    assert [e["attempt"] for e in job.attempt_errors] == [1, 2]
    assert all("signal 9" in e["error"] for e in job.attempt_errors)
    assert step_count(db, job_id) == 3  # what it wrote survives


def test_child_exiting_without_a_result_is_a_readable_failure(
    db: Database, supervisor: Supervisor
) -> None:
    job_id = make_job(db, {"mode": "exit_silently"}, max_attempts=1)
    supervisor.run_once()
    job = load(db, job_id)
    assert job.status == "failed"
    assert "exited with code 3" in (job.error or "")


def test_child_exception_is_retried_then_fails_with_the_exception(
    db: Database, supervisor: Supervisor
) -> None:
    job_id = make_job(db, {"mode": "raise"}, max_attempts=3)
    for _ in range(3):
        supervisor.run_once()
    job = load(db, job_id)
    assert job.status == "failed"
    assert job.error is not None and job.error.startswith("ValueError: boom")
    assert len(job.attempt_errors) == 3


def test_job_error_fails_at_once_without_retry(db: Database, supervisor: Supervisor) -> None:
    job_id = make_job(db, {"mode": "job_error"}, max_attempts=3)
    supervisor.run_once()
    job = load(db, job_id)
    assert job.status == "failed" and job.error == "bad data" and job.attempt == 1


def test_cancel_of_running_job_stops_it_and_keeps_history(
    db: Database, background: Supervisor
) -> None:
    job_id = make_job(db, {"mode": "slow", "steps": 10_000, "interval": 0.01})
    wait_for(lambda: step_count(db, job_id) >= 20)
    with db.write() as s:
        jobs.request_cancel(s, job_id, utcnow())
    wait_for(lambda: load(db, job_id).status == "cancelled")
    job = load(db, job_id)
    kept = step_count(db, job_id)
    assert kept >= 20 and job.last_step == kept - 1


def test_cancel_of_a_deaf_child_ends_with_sigkill_after_grace(
    db: Database, settings: Settings
) -> None:
    settings.cancel_grace_seconds = 0.5
    sup = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    job_id = make_job(db, {"mode": "ignore_sigterm", "steps": 10_000, "interval": 0.01})
    thread = threading.Thread(target=sup.run_once)
    thread.start()
    wait_for(lambda: step_count(db, job_id) >= 5)
    with db.write() as s:
        jobs.request_cancel(s, job_id, utcnow())
    thread.join(timeout=30)
    assert load(db, job_id).status == "cancelled"


def test_hung_child_is_killed_and_the_job_fails_saying_so(db: Database, settings: Settings) -> None:
    settings.hang_timeout_seconds = 1.0
    sup = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    job_id = make_job(db, {"mode": "hang"})
    started = time.monotonic()
    sup.run_once()
    job = load(db, job_id)
    assert job.status == "failed"
    assert "no progress from the training process for 1 s" in (job.error or "")
    assert time.monotonic() - started < 20


def test_shutdown_gives_the_running_job_back_to_the_queue(db: Database, settings: Settings) -> None:
    sup = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    job_id = make_job(db, {"mode": "slow", "steps": 10_000, "interval": 0.01})
    thread = threading.Thread(target=sup.run_forever)
    thread.start()
    wait_for(lambda: step_count(db, job_id) >= 5)
    sup.stop()
    thread.join(timeout=30)
    job = load(db, job_id)
    assert job.status == "queued" and job.attempt == 0 and job.worker_id is None


def test_lost_lease_kills_the_child_and_leaves_the_job_to_its_new_owner(
    db: Database, settings: Settings
) -> None:
    sup = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    job_id = make_job(db, {"mode": "slow", "steps": 10_000, "interval": 0.01})
    thread = threading.Thread(target=sup.run_once)
    thread.start()
    wait_for(lambda: step_count(db, job_id) >= 5)
    with db.write() as s:  # another worker took the job over (as after a lease expiry)
        job = s.get(Job, job_id)
        assert job is not None
        job.worker_id = "someone-else"
    thread.join(timeout=30)
    assert not thread.is_alive()
    job = load(db, job_id)
    assert job.status == "running" and job.worker_id == "someone-else"


def test_an_attempt_that_ends_after_its_lease_was_taken_over_writes_nothing_into_the_job(
    db: Database, settings: Settings
) -> None:
    """The outcome is recorded in a transaction of its own after the last renewal; if another
    worker reclaimed the job in between, neither the failure nor the requeue is ours."""
    from workers.attempt import Attempt, Outcome

    sup = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    job_id = make_job(db, {})
    with db.write() as s:
        claim = jobs.claim_next(s, worker_id="w", lease_seconds=30, gpus_held=0)
        assert claim is not None and claim.job_id == job_id
    with db.write() as s:  # w's lease ran out and "new-owner" reclaimed the job (attempt 2)
        job = s.get(Job, job_id)
        assert job is not None
        job.worker_id, job.attempt = "new-owner", 2
    outcome = sup._record_outcome(Attempt(job_id=job_id, attempt=1), Outcome("retry", "boom"))
    assert outcome.status == "lost"
    job = load(db, job_id)
    assert (job.status, job.worker_id, job.attempt, job.attempt_errors) == (
        "running",
        "new-owner",
        2,
        [],
    )


def test_json_logs_carry_the_job_and_worker_ids(db: Database, settings: Settings) -> None:
    import json
    import logging

    from service.logs import JsonFormatter

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("halfway.worker")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        job_id = make_job(db, {"steps": 3})
        Supervisor(db, settings, trainer=fakes.trainer, worker_id="w-json").run_once()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    entries = [json.loads(line) for line in lines]
    finished = [e for e in entries if e.get("status") == "succeeded"]
    assert finished and finished[0]["job_id"] == job_id and finished[0]["worker_id"] == "w-json"
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
