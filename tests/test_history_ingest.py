"""The history write path at real batch sizes: appending batches take the fast path on
PostgreSQL (rollups merged, not recomputed), anything else the general one, and both leave
exactly what a recomputation from the stored rows gives; the supervisor's flushes that do
not wait for the disk write again whatever a database crash took back. SQLite and
PostgreSQL."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import delete, func, select, text

from service.database.db import Database
from service.database.models import Job, ScaleEvent, Step, StepRollup, utcnow
from service.recording import history, ingest
from service.recording.records import StepRecord
from service.recording.rollups import refresh_rollups
from service.scheduling import jobs
from service.settings import Settings
from tests.conftest import Api
from tests.test_history_queries import submit, synthetic_history, write
from workers.attempt import Attempt
from workers.flush import RELAXED_FLUSHES
from workers.supervisor import Supervisor

ROLLUP_FIELDS = (
    "level",
    "block",
    "first_step",
    "last_step",
    "count",
    "loss_min",
    "loss_max",
    "loss_last",
    "scale_min",
    "scale_max",
    "scale_last",
    "overflow_count",
    "nonfinite_loss_count",
)


def _rollup_rows(s: Any, job_id: int) -> list[tuple[Any, ...]]:
    rows = s.scalars(
        select(StepRollup)
        .where(StepRollup.job_id == job_id)
        .order_by(StepRollup.level, StepRollup.block)
    ).all()
    return [
        tuple(
            "nan" if isinstance(v, float) and math.isnan(v) else v
            for v in (getattr(r, name) for name in ROLLUP_FIELDS)
        )
        for r in rows
    ]


def rollups(db: Database, job_id: int) -> list[tuple[Any, ...]]:
    with db.read() as s:
        return _rollup_rows(s, job_id)


def recomputed(db: Database, job_id: int, lo: int, hi: int) -> list[tuple[Any, ...]]:
    """The rollups as the general path computes them from the stored rows (rolled back)."""
    with db.write_sessions() as s, s.begin():
        s.execute(delete(StepRollup).where(StepRollup.job_id == job_id))
        refresh_rollups(s, job_id, lo, hi)
        s.flush()
        out = _rollup_rows(s, job_id)
        s.rollback()
    return out


def events(db: Database, job_id: int) -> list[tuple[int, float, float, str]]:
    with db.read() as s:
        return [
            (e.step, e.old_scale, e.new_scale, e.reason)
            for e in s.scalars(
                select(ScaleEvent).where(ScaleEvent.job_id == job_id).order_by(ScaleEvent.step)
            )
        ]


def expected_events(records: list[StepRecord]) -> list[tuple[int, float, float, str]]:
    return [
        (e["step"], e["old_scale"], e["new_scale"], e["reason"])
        for e in history.scale_events(records, None)
    ]


def summary(db: Database, job_id: int) -> dict[str, Any]:
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return {
            "last_step": job.last_step,
            "overflow_count": job.overflow_count,
            "nonfinite_loss_count": job.nonfinite_loss_count,
            "growth_count": job.growth_count,
            "backoff_count": job.backoff_count,
            "min_loss_scale": job.min_loss_scale,
            "loss_scale": job.loss_scale,
        }


def expected_summary(records: list[StepRecord]) -> dict[str, Any]:
    evs = history.scale_events(records, None)
    return {
        "last_step": records[-1].step,
        "overflow_count": sum(1 for r in records if not r.finite),
        "nonfinite_loss_count": sum(1 for r in records if not math.isfinite(r.loss)),
        "growth_count": sum(1 for e in evs if e["reason"] == "growth"),
        "backoff_count": sum(1 for e in evs if e["reason"] == "overflow"),
        "min_loss_scale": min(r.loss_scale for r in records),
        "loss_scale": records[-1].loss_scale,
    }


def stored_steps(db: Database, job_id: int) -> list[int]:
    with db.read() as s:
        return list(s.scalars(select(Step.step).where(Step.job_id == job_id).order_by(Step.step)))


def test_appended_batches_leave_every_rollup_level_as_a_recomputation_would(
    api: Api, db: Database
) -> None:
    job_id = submit(api)
    # Across a level-2 block edge (262144), in batches that straddle every level's edges.
    records = synthetic_history(9000, seed=11, start=262144 - 4500)
    write(db, job_id, records[:4500], batch=333)
    write(db, job_id, records[4500:], batch=ingest.COPY_ROWS + 1)  # rows by COPY
    assert rollups(db, job_id) == recomputed(db, job_id, records[0].step, records[-1].step)
    with db.read() as s:  # NaN is stored as NULL, +/-inf as themselves, on every path
        null_losses = s.scalar(
            select(func.count()).where(Step.job_id == job_id, Step.loss.is_(None))
        )
        infinite = s.scalars(
            select(Step.loss).where(Step.job_id == job_id, Step.loss.in_([math.inf, -math.inf]))
        ).all()
    assert null_losses == sum(1 for r in records if math.isnan(r.loss)) > 0
    assert sorted(infinite) == sorted(r.loss for r in records if math.isinf(r.loss))
    assert len(infinite) > 0
    assert events(db, job_id) == expected_events(records)
    assert summary(db, job_id) == expected_summary(records)


def test_a_batch_overlapping_stored_rows_changes_nothing_twice(api: Api, db: Database) -> None:
    job_id = submit(api)
    records = synthetic_history(1500, seed=12)
    write(db, job_id, records[:700], batch=333)
    write(db, job_id, records[600:1200], batch=600)  # 100 rows stored already, 500 new
    write(db, job_id, records[1100:], batch=1000)
    write(db, job_id, records[1400:], batch=1000)  # resent whole
    assert stored_steps(db, job_id) == [r.step for r in records]
    assert rollups(db, job_id) == recomputed(db, job_id, 0, 1499)
    assert events(db, job_id) == expected_events(records)
    assert summary(db, job_id) == expected_summary(records)


def test_a_scale_change_on_the_first_step_of_a_batch_is_an_event(api: Api, db: Database) -> None:
    job_id = submit(api)
    records = [StepRecord(s, 0, 1.0, 1024.0 if s < 333 else 512.0, s != 332) for s in range(666)]
    write(db, job_id, records, batch=333)
    assert events(db, job_id) == [(333, 1024.0, 512.0, "overflow")]
    assert summary(db, job_id)["backoff_count"] == 1


def claimed(db: Database, api: Api, worker_id: str) -> int:
    job_id = submit(api)
    with db.write() as s:
        claim = jobs.claim_next(s, worker_id=worker_id, lease_seconds=30, gpus_held=0)
        assert claim is not None and claim.job_id == job_id
    return job_id


def test_renew_and_load_is_fenced_like_the_lease_renewal(api: Api, db: Database) -> None:
    job_id = claimed(db, api, "w1")
    with db.write() as s:
        job = jobs.renew_and_load(s, job_id=job_id, worker_id="w1", lease_seconds=30)
        assert job is not None and job.id == job_id and job.worker_id == "w1"
        assert job.cancel_requested is False
    with db.write() as s:
        assert jobs.renew_and_load(s, job_id=job_id, worker_id="w2", lease_seconds=30) is None


# 333: the one-statement flush after the first (which loads the job); 1000: the general path.
@pytest.mark.parametrize("batch", [333, ingest.COPY_ROWS])
def test_rows_a_database_crash_took_back_are_written_again_by_the_next_flush(
    api: Api, db: Database, settings: Settings, batch: int
) -> None:
    job_id = claimed(db, api, "w1")
    supervisor = Supervisor(db, settings, worker_id="w1")
    run = Attempt(job_id=job_id, attempt=1)
    records = synthetic_history(3000, seed=13)
    for i in range(0, 2000, batch):
        run.pending = records[i : min(i + batch, 2000)]
        assert supervisor._sync(run)
    assert run.unsynced == records[:2000] and run.relaxed_flushes == -(-2000 // batch)
    # What a crash leaves when the last commits had not reached the disk: the database as it
    # was before them. Cut where the scale is the one the worker wrote last, so that only the
    # last step tells the worker its history moved.
    cut = min(i for i in range(1000, 1999) if records[i - 1].loss_scale == records[1999].loss_scale)
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        history.truncate_after(s, job, cut)
    for i in range(2000, 3000, batch):
        run.pending = records[i : i + batch]
        assert supervisor._sync(run)
    assert stored_steps(db, job_id) == list(range(3000))
    assert summary(db, job_id) == expected_summary(records)
    assert rollups(db, job_id) == recomputed(db, job_id, 0, 2999)
    assert events(db, job_id) == expected_events(records)


def test_every_few_flushes_one_waits_for_the_disk_and_forgets_the_kept_rows(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = claimed(db, api, "w1")
    supervisor = Supervisor(db, settings, worker_id="w1")
    run = Attempt(job_id=job_id, attempt=1)
    records = synthetic_history(10 * (RELAXED_FLUSHES + 1), seed=14)
    for i in range(RELAXED_FLUSHES):
        run.pending = records[i * 10 : (i + 1) * 10]
        assert supervisor._sync(run)
    assert len(run.unsynced) == RELAXED_FLUSHES * 10
    run.pending = records[RELAXED_FLUSHES * 10 :]
    assert supervisor._sync(run)
    assert run.unsynced == [] and run.relaxed_flushes == 0
    # A flush that carries more than history (here: an acknowledged checkpoint) waits too.
    run.pending = synthetic_history(10, seed=15, start=len(records))
    assert supervisor._sync(run) and run.relaxed_flushes == 1
    run.pending = synthetic_history(10, seed=16, start=len(records) + 10)
    run.updates = {"checkpoint_step": len(records)}
    assert supervisor._sync(run)
    assert run.unsynced == [] and run.relaxed_flushes == 0
    assert stored_steps(db, job_id) == list(range(len(records) + 20))


@pytest.mark.parametrize("batch", [333, ingest.COPY_ROWS])
def test_an_appending_batch_that_meets_a_stored_row_after_all_is_written_exactly(
    api: Api, db: Database, batch: int
) -> None:
    job_id = submit(api)
    records = synthetic_history(2000, seed=17)
    write(db, job_id, records[:1000])
    stray = records[1005]  # stored behind the summary's back (its own values)
    with db.write() as s:
        s.add(Step(job_id=job_id, **stray._asdict()))
    write(db, job_id, records[1000:], batch=batch)
    assert stored_steps(db, job_id) == list(range(2000))
    assert rollups(db, job_id) == recomputed(db, job_id, 0, 1999)
    assert events(db, job_id) == expected_events(records)
    assert summary(db, job_id) == expected_summary(records)


@pytest.mark.parametrize("durable", [True, False])
def test_a_write_that_need_not_be_durable_commits_without_waiting_for_the_disk(
    api: Api, db: Database, durable: bool
) -> None:
    job_id = submit(api)
    records = synthetic_history(600, seed=18)
    for batch in (records[:300], records[300:], records[200:400]):  # appends, then a resend
        with db.write() as s:
            job = s.get(Job, job_id)
            assert job is not None
            history.write_steps(s, job, batch, now=utcnow(), durable=durable)
            if db.dialect == "postgresql":
                setting = s.execute(text("SHOW synchronous_commit")).scalar()
                assert setting == ("on" if durable else "off")
    assert stored_steps(db, job_id) == list(range(600))
    assert summary(db, job_id) == expected_summary(records)


def counters(db: Database, job_id: int) -> dict[str, Any]:
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return {
            "steps_recorded": job.steps_recorded,
            "overflows_recorded": job.overflows_recorded,
            "backoffs_recorded": job.backoffs_recorded,
            "epoch": job.epoch,
            "last_loss": "nan" if math.isnan(job.last_loss or 0.0) else job.last_loss,
            "history_version": job.history_version,
        }


def expected_counters(records: list[StepRecord], history_version: int = 0) -> dict[str, Any]:
    evs = history.scale_events(records, None)
    last = records[-1]
    return {
        "steps_recorded": len(records),
        "overflows_recorded": sum(1 for r in records if not r.finite),
        "backoffs_recorded": sum(1 for e in evs if e["reason"] == "overflow"),
        "epoch": last.epoch,
        "last_loss": "nan" if math.isnan(last.loss) else last.loss,
        "history_version": history_version,
    }


def flush(supervisor: Supervisor, run: Attempt, records: list[StepRecord], batch: int) -> None:
    for i in range(0, len(records), batch):
        run.pending = records[i : i + batch]
        assert supervisor._sync(run)
        assert not run.lease_lost and run.pending == []


def test_flushes_of_a_few_hundred_rows_leave_rollups_events_and_counters_exact(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = claimed(db, api, "w1")
    supervisor = Supervisor(db, settings, worker_id="w1")
    run = Attempt(job_id=job_id, attempt=1)
    # Across a level-2 block edge, with overflows, growth, NaN and infinite losses; a scale
    # change falls on the first step of a batch (333 * 3), where only the job's summary
    # knows the scale before it.
    records = synthetic_history(6000, seed=21, start=262144 - 3000)
    change = 999
    records = [
        r._replace(loss_scale=r.loss_scale / 2 if i >= change else r.loss_scale)
        for i, r in enumerate(records)
    ]
    flush(supervisor, run, records, 333)
    first, last = records[0].step, records[-1].step
    assert stored_steps(db, job_id) == list(range(first, last + 1))
    assert rollups(db, job_id) == recomputed(db, job_id, first, last)
    assert events(db, job_id) == expected_events(records)
    assert (records[change].step, "overflow") in [(e[0], e[3]) for e in events(db, job_id)]
    assert summary(db, job_id) == expected_summary(records)
    assert counters(db, job_id) == expected_counters(records)


def test_a_worker_whose_lease_was_taken_over_writes_nothing_with_its_next_flush(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = claimed(db, api, "w1")
    supervisor = Supervisor(db, settings, worker_id="w1")
    run = Attempt(job_id=job_id, attempt=1)
    records = synthetic_history(1000, seed=22)
    flush(supervisor, run, records[:666], 333)
    with db.write() as s:  # w1's lease ran out and w2 reclaimed the job
        s.execute(
            text("UPDATE job SET lease_expires_at = :t WHERE id = :id"),
            {"t": utcnow() - timedelta(seconds=1), "id": job_id},
        )
    with db.write() as s:
        claim = jobs.claim_next(s, worker_id="w2", lease_seconds=30, gpus_held=0)
        assert claim is not None and claim.job_id == job_id and claim.attempt == 2
    with db.read() as s:
        before = s.execute(select(Job.lease_expires_at, Job.updated_at).where(Job.id == job_id))
        lease_before = before.one()
    run.pending = records[666:]
    assert supervisor._sync(run)
    assert run.lease_lost
    assert stored_steps(db, job_id) == list(range(666))
    assert summary(db, job_id) == expected_summary(records[:666])
    assert counters(db, job_id) == expected_counters(records[:666])
    assert rollups(db, job_id) == recomputed(db, job_id, 0, 665)
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        assert job.worker_id == "w2"
        assert (job.lease_expires_at, job.updated_at) == tuple(lease_before)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_flush_on_a_connection_the_database_dropped_goes_again_on_a_new_one(
    api: Api, db: Database, settings: Settings
) -> None:
    job_id = claimed(db, api, "w1")
    supervisor = Supervisor(db, settings, worker_id="w1")
    run = Attempt(job_id=job_id, attempt=1)
    records = synthetic_history(999, seed=23)
    flush(supervisor, run, records[:666], 333)
    name = "halfway-worker w1"
    backends = text("SELECT pid FROM pg_stat_activity WHERE application_name = :name")
    with db.engine.connect() as conn:  # as a server restart or a cut idle connection would
        (pid,) = conn.execute(backends, {"name": name}).scalars().all()
        # Waits for the backend to exit (its second argument: a timeout in milliseconds).
        ended = text("SELECT pg_terminate_backend(:pid, 30000)")
        assert conn.execute(ended, {"pid": pid}).scalar()
    flush(supervisor, run, records[666:], 333)
    assert stored_steps(db, job_id) == list(range(999))
    assert summary(db, job_id) == expected_summary(records)
    assert counters(db, job_id) == expected_counters(records)
    assert rollups(db, job_id) == recomputed(db, job_id, 0, 998)
    assert events(db, job_id) == expected_events(records)
    with db.engine.connect() as conn:  # that flush went through the worker's connection
        (again,) = conn.execute(backends, {"name": name}).scalars().all()
    assert again != pid
    supervisor.close()
