"""Gradient samples through the supervisor: what a fake child sends is stored by the fenced
flush (the general transaction only: young samples wait for one, old ones force it), cut
with the history on a resume (history_version moves, none lost, none twice), never written
by an attempt that lost its lease; the precision decision is stored and handed to the next
attempt; an alarm becomes a job warning. Fake trainers (no TensorFlow), SQLite and
PostgreSQL."""

from __future__ import annotations

import time

from sqlalchemy import func, select

from service.database.db import Database
from service.database.models import GradientSample, Job
from service.recording import gradients
from service.recording.records import StepRecord
from service.scheduling import jobs
from service.settings import Settings
from tests import fakes
from tests.conftest import Api
from tests.test_gradient_store import sample, stored
from tests.test_supervisor import load, make_job
from tests.waiting import eventually
from workers.attempt import Attempt
from workers.flush import GRADIENTS_HOLD_SECONDS
from workers.supervisor import Supervisor


def sample_count(db: Database, job_id: int) -> int:
    with db.read() as s:
        query = select(func.count()).where(GradientSample.job_id == job_id)
        return int(s.scalar(query) or 0)


def test_a_job_sampling_its_gradients_stores_every_sample_its_decision_and_its_alarm(
    db: Database, settings: Settings, api: Api
) -> None:
    fake = {
        "steps": 37,
        "batch": 5,
        "gradients_every": 4,
        "shadow_every": 8,
        "decision": True,
        "alarm_at": 20,
    }
    job_id = make_job(db, fake)
    assert Supervisor(db, settings, trainer=fakes.trainer, worker_id="w").run_once()
    job = load(db, job_id)
    assert job.status == "succeeded", job.error
    found = stored(db, job_id)
    assert [s["step"] for s in found] == list(range(0, 37, 4))
    assert found == [sample(s, shadow=s % 8 == 0) for s in range(0, 37, 4)]
    assert job.gradients_summary == {
        "latest": gradients.model_level(sample(36, shadow=False)),
        "latest_shadow": gradients.model_level(sample(32, shadow=True)),
    }
    assert job.precision_decision == gradients.clean_decision(fakes.DECISION)
    assert job.warnings.count(fakes.alarm_text(20)) == 1
    shown = eventually(
        lambda: api.get(f"/v1/jobs/{job_id}").json(), lambda j: j["status"] == "succeeded"
    )
    assert shown["precision_decision"]["policy"] == "mixed_float16"
    assert [p["policy"] for p in shown["precision_decision"]["probes"]] == [
        "float32",
        "mixed_bfloat16",
        "mixed_float16",
    ]
    assert shown["gradients"]["latest"]["step"] == 36


def test_a_resume_replaces_the_samples_from_its_cut_with_none_lost_and_none_twice(
    db: Database, settings: Settings, api: Api
) -> None:
    """Attempt 1 samples steps 0..190, checkpoints at 128 and is killed; attempt 2 resumes
    from 128 (with the stored decision, deciding nothing) and samples 130..190 again."""
    meter = {"gradients_every": 10, "shadow_every": 50, "decision": True}
    plan = [
        {"until": 200, "checkpoint_at": 128, "then": "crash", **meter},
        {"until": 200, "then": "succeed", **meter},
    ]
    job_id = make_job(db, {"mode": "plan", "plan": plan}, max_attempts=2)
    supervisor = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    assert supervisor.run_once()
    first = load(db, job_id)
    assert first.status == "queued" and first.checkpoint_step == 128
    assert [s["step"] for s in stored(db, job_id)] == list(range(0, 200, 10))
    assert first.precision_decision is not None
    assert supervisor.run_once()
    job = load(db, job_id)
    assert job.status == "succeeded", job.error
    assert (job.history_version, job.history_reset_step) == (1, 128)
    found = stored(db, job_id)
    assert found == [
        sample(s, shadow=s % 50 == 0, attempt=1 if s < 128 else 2) for s in range(0, 200, 10)
    ]
    # The second attempt got the decision in its payload and did not decide again.
    assert job.precision_decision == gradients.clean_decision(fakes.DECISION)
    assert fakes.decision_note("mixed_float16") in job.notes
    assert job.gradients_summary is not None
    assert job.gradients_summary["latest"] == gradients.model_level(sample(190, attempt=2))
    assert job.gradients_summary["latest_shadow"] == gradients.model_level(
        sample(150, shadow=True, attempt=2)
    )
    page = api.get(f"/v1/jobs/{job_id}/gradients?after_step=127").json()
    assert page["history_version"] == 1
    assert [s["zero_share"] for s in page["samples"]] == [0.015625] * 7


def test_the_stored_decision_goes_into_the_next_attempts_payload(
    db: Database, settings: Settings
) -> None:
    job_id = make_job(db, {})
    decision = gradients.clean_decision(fakes.DECISION)
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.precision_decision = decision
    with db.write() as s:
        claim = jobs.claim_next(s, worker_id="w", lease_seconds=30, gpus_held=0)
    assert claim is not None and claim.precision_decision == decision
    payload = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")._payload(claim, [])
    assert payload["precision_decision"] == decision
    other = make_job(db, {})
    with db.write() as s:
        claim = jobs.claim_next(s, worker_id="w", lease_seconds=30, gpus_held=0)
    assert claim is not None and claim.job_id == other and claim.precision_decision is None


def _claimed(db: Database, settings: Settings) -> tuple[Supervisor, Attempt]:
    job_id = make_job(db, {})
    with db.write() as s:
        claim = jobs.claim_next(s, worker_id="w", lease_seconds=30, gpus_held=0)
    assert claim is not None and claim.job_id == job_id
    supervisor = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    return supervisor, Attempt(job_id=job_id, attempt=1)


def _pending(run: Attempt, steps: range, *, age: float = 0.0) -> None:
    run.pending += [StepRecord(*r) for r in fakes._records(steps.start, len(steps))]
    run.new_gradients += [sample(s) for s in steps if s % 10 == 0]
    if run.gradients_since is None:
        run.gradients_since = time.monotonic() - age


def test_an_attempt_that_lost_its_lease_writes_no_sample(db: Database, settings: Settings) -> None:
    supervisor, run = _claimed(db, settings)
    _pending(run, range(0, 30))
    with db.write() as s:  # another worker reclaimed the job
        job = s.get(Job, run.job_id)
        assert job is not None
        job.worker_id = "thief"
    run.ending = True
    assert supervisor.writer.sync(run)
    assert run.lease_lost
    assert sample_count(db, run.job_id) == 0
    assert load(db, run.job_id).gradients_summary is None
    supervisor.close()


def test_samples_ride_the_general_flush_and_force_it_only_once_old(
    db: Database, settings: Settings
) -> None:
    """On PostgreSQL a history-only flush is one statement that writes no sample: young
    samples wait for a general flush (which anything else pending forces), and force one
    themselves after GRADIENTS_HOLD_SECONDS. On SQLite every flush is the general one."""
    supervisor, run = _claimed(db, settings)
    _pending(run, range(0, 10))
    assert supervisor.writer.sync(run)  # the first flush is general (nothing held yet)
    assert sample_count(db, run.job_id) == 1 and run.new_gradients == []
    fast = db.dialect == "postgresql"

    _pending(run, range(10, 30))
    assert supervisor.writer.sync(run)
    assert sample_count(db, run.job_id) == (1 if fast else 3)
    assert len(run.new_gradients) == (2 if fast else 0)
    assert load(db, run.job_id).last_step == 29  # the steps went in either way

    _pending(run, range(30, 40))
    if fast:
        run.gradients_since = time.monotonic() - GRADIENTS_HOLD_SECONDS - 0.1
    assert supervisor.writer.sync(run)
    assert sample_count(db, run.job_id) == 4 and run.gradients_since is None

    _pending(run, range(40, 50))
    # A checkpoint's acknowledgement forces the general path and carries every sample sent
    # before it: a worker killed after it loses only samples its resume takes again.
    run.updates["checkpoint_step"] = 50
    assert supervisor.writer.sync(run)
    assert sample_count(db, run.job_id) == 5 and load(db, run.job_id).checkpoint_step == 50

    _pending(run, range(50, 55))
    run.metrics = {"timing": {"x": 1.0}}  # so does anything else that is not history
    assert supervisor.writer.sync(run)
    assert sample_count(db, run.job_id) == 6

    _pending(run, range(55, 70))
    run.ending = True  # the attempt's last flushes write everything
    assert supervisor.writer.sync(run)
    assert sample_count(db, run.job_id) == 7 and run.new_gradients == []
    job = load(db, run.job_id)
    assert job.gradients_summary is not None
    assert job.gradients_summary["latest"]["step"] == 60
    assert [s["step"] for s in stored(db, run.job_id)] == list(range(0, 70, 10))
    supervisor.close()


def test_a_malformed_sample_or_decision_is_dropped_not_stored(
    db: Database, settings: Settings
) -> None:
    supervisor, run = _claimed(db, settings)
    supervisor._take_gradients(run, [{"step": "x"}, fakes.fake_sample(0), None])
    supervisor._take_decision(run, {"reason": "no policy"})
    assert [s["step"] for s in run.new_gradients] == [0]
    assert "precision_decision" not in run.updates
    assert supervisor.writer.sync(run)
    assert sample_count(db, run.job_id) == 1
    assert load(db, run.job_id).precision_decision is None
    supervisor.close()


def test_samples_are_written_with_the_steps_at_the_end_of_a_run(
    db: Database, settings: Settings
) -> None:
    """A slow job's samples, stored by the time it ends (the end forces the general flush)."""
    fake = {"mode": "slow", "steps": 25, "interval": 0.01, "gradients_every": 5}
    job_id = make_job(db, fake)
    assert Supervisor(db, settings, trainer=fakes.trainer, worker_id="w").run_once()
    assert load(db, job_id).status == "succeeded"
    assert [s["step"] for s in stored(db, job_id)] == [0, 5, 10, 15, 20]
