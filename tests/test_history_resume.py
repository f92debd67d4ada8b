"""History after a resume: ``truncate_after`` forgets the steps from the cut on, and everything
derived from them (the rollups at every level, the scale events, the job's summary) must equal
a computation from scratch over the rows that remain, whether the resumed attempt writes again
or dies first. Aligned and unaligned cuts at every rollup level, and a property test of random
write/truncate sequences, on SQLite and PostgreSQL."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from service.database.db import Database
from service.database.models import Job, ScaleEvent, StepRollup, utcnow
from service.recording import history, rollups
from service.recording.heldflush import Held, HeldAppender
from service.recording.records import StepRecord
from service.recording.rollups import LEVEL_BLOCKS
from tests.conftest import Api
from tests.test_history_queries import brute_force, check_buckets, submit, synthetic_history, write

WORKER = "property-worker"


def new_job(db: Database, worker_id: str | None = None) -> int:
    """A job to write history into; with ``worker_id``, running and held by that worker (as
    the held flush's fence requires)."""
    with db.write() as s:
        job = Job(owner="alice", name="resume", spec={})
        if worker_id is not None:
            job.status, job.worker_id = "running", worker_id
        s.add(job)
        s.flush()
        return job.id


def held_write(
    db: Database,
    appender: HeldAppender | None,
    job_id: int,
    records: list[StepRecord],
    held: Held | None,
) -> Held:
    """Write ``records`` as the supervisor's flush does, in batches under ``COPY_ROWS``: by
    the one-statement held flush when it takes a batch, else by the general path, whose
    result is where the next held flush starts. Returns where the history ends now."""
    for i in range(0, len(records), 997):
        batch = records[i : i + 997]
        written = None
        if appender is not None and held is not None:
            with db.read() as s:
                job = s.get(Job, job_id)
                assert job is not None
                actual = Held.of(job)
            written = appender.append(
                job_id=job_id,
                worker_id=WORKER,
                lease_seconds=60,
                held=held,
                records=batch,
                steps_per_second=None,
                durable=True,
            )
            # The held flush takes a batch that appends where the history really ends, and
            # refuses one whose writer believes it ends elsewhere (a cut since).
            assert (written is not None) == (actual == held), (held, actual)
        if written is not None:
            held = written.held
            continue
        with db.write() as s:
            job = s.get(Job, job_id)
            assert job is not None
            history.write_steps(s, job, batch, now=utcnow())
            held = Held.of(job)
    assert held is not None
    return held


def truncate(db: Database, job_id: int, step: int) -> None:
    with db.write() as s:
        job = s.get(Job, job_id)
        assert job is not None
        history.truncate_after(s, job, step)


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or a == b


def expected_rollups(records: list[StepRecord]) -> dict[tuple[int, int], dict[str, Any]]:
    """Every rollup block of every level, computed from the rows alone."""
    out = {}
    for level, size in enumerate(LEVEL_BLOCKS):
        for cell in brute_force(records, 0, 2**31, 0, size).values():
            out[(level, cell["index"])] = cell
    return out


def check_rollups(db: Database, job_id: int, records: list[StepRecord]) -> None:
    expected = expected_rollups(records)
    by_step = {r.step: r for r in records}
    with db.read() as s:
        stored = {
            (r.level, r.block): r for r in s.scalars(select(StepRollup).filter_by(job_id=job_id))
        }
    assert sorted(stored) == sorted(expected), "a rollup block for steps that do not exist"
    for key, want in expected.items():
        got = stored[key]
        assert (got.first_step, got.last_step, got.count) == (
            want["first_step"],
            want["last_step"],
            want["count"],
        ), key
        assert (got.overflow_count, got.nonfinite_loss_count) == (
            want["overflow_count"],
            want["nonfinite_loss_count"],
        ), key
        assert _same(got.loss_min, want["loss_min"]) and _same(got.loss_max, want["loss_max"]), key
        assert (got.scale_min, got.scale_max, got.scale_last) == (
            want["scale_min"],
            want["scale_max"],
            want["scale_last"],
        ), key
        assert _same(got.loss_last, by_step[want["last_step"]].loss), key


def check_derived(db: Database, job_id: int, records: list[StepRecord]) -> None:
    """Rollups, scale events and the job's summary against the rows that remain."""
    check_rollups(db, job_id, records)
    ordered = sorted(records, key=lambda r: r.step)
    events = [
        (
            b.step,
            a.loss_scale,
            b.loss_scale,
            "overflow" if b.loss_scale < a.loss_scale else "growth",
        )
        for a, b in itertools.pairwise(ordered)
        if b.step == a.step + 1 and a.loss_scale != b.loss_scale
    ]
    with db.read() as s:
        stored = [
            (e.step, e.old_scale, e.new_scale, e.reason)
            for e in s.scalars(
                select(ScaleEvent).filter_by(job_id=job_id).order_by(ScaleEvent.step)
            )
        ]
        job = s.get(Job, job_id)
        assert job is not None
        assert stored == events
        assert job.last_step == (ordered[-1].step if ordered else None)
        assert job.overflow_count == sum(1 for r in ordered if not r.finite)
        assert job.nonfinite_loss_count == sum(1 for r in ordered if not math.isfinite(r.loss))
        assert job.min_loss_scale == (min(r.loss_scale for r in ordered) if ordered else None)
        assert job.growth_count == sum(1 for e in events if e[3] == "growth")
        assert job.backoff_count == sum(1 for e in events if e[3] == "overflow")


# A cut on a block boundary of each level, and one inside a block of each level, each with
# history going on past the next block of that level, so that there are blocks to forget.
CUTS = [
    pytest.param(64, 300, id="aligned-level0"),
    pytest.param(1024, 2500, id="aligned-level1"),
    pytest.param(16384, 16384 + 2000, id="aligned-level2"),
    pytest.param(262144, 262144 + 5000, id="aligned-level3"),
    pytest.param(100, 300, id="unaligned-level0"),
    pytest.param(1024 + 64 * 3 + 5, 2500, id="unaligned-level1"),
    pytest.param(16384 + 1024 + 64, 16384 + 2000, id="unaligned-level2"),
    pytest.param(262144 + 16384 + 64, 262144 + 18_000, id="unaligned-level3"),
]


@pytest.mark.parametrize(("cut", "n"), CUTS)
def test_rollups_after_a_cut_equal_the_rows_left_before_and_after_writing_again(
    api: Api, db: Database, cut: int, n: int
) -> None:
    # Both states a cut leaves on one history: a resumed attempt that died before writing
    # (checked right after the cut), then one that trains the same steps again, to other
    # values, but not as far. The checks only read, so the second state is the one a fresh
    # job cut and written again would reach; the level-3 histories are written once, not twice.
    job_id = submit(api)
    records = synthetic_history(n, seed=cut)
    write(db, job_id, records, batch=50_000)
    truncate(db, job_id, cut)
    kept = records[:cut]
    check_cut(api, db, job_id, kept, cut)
    again = synthetic_history(LEVEL_BLOCKS[0] + 9, seed=cut + 1, start=cut)
    write(db, job_id, again, batch=50_000)
    check_cut(api, db, job_id, kept + again, cut)


def check_cut(api: Api, db: Database, job_id: int, kept: list[StepRecord], cut: int) -> None:
    """Derived data equal to the rows ``kept``; buckets at the level the cut tests, and at the
    finest, over the whole job and zoomed around the cut."""
    check_derived(db, job_id, kept)
    for points in (1, 2, 3, 7, 50):
        check_buckets(api, job_id, kept, points)
    check_buckets(api, job_id, kept, 5, max(0, cut - 300), cut + 300)


def test_a_cut_at_step_zero_forgets_everything(api: Api, db: Database) -> None:
    job_id = submit(api)
    write(db, job_id, synthetic_history(5000, seed=1))
    truncate(db, job_id, 0)
    check_derived(db, job_id, [])
    page = api.get(f"/v1/jobs/{job_id}/history?points=3").json()
    assert page["buckets"] == []


# --------------------------------------------------------------------------------------------
# The property: any sequence of writes, rewrites and cuts leaves derived data equal to a
# computation from scratch.

ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(1, 9000)),
        # As a running job's supervisor writes: the one-statement held flush where it can
        # take the batch (PostgreSQL, appending where it last left the history), else the
        # general path, as workers/flush.py does.
        st.tuples(st.just("held_write"), st.integers(1, 3000)),
        st.tuples(st.just("rewrite"), st.floats(0, 1), st.integers(1, 500)),
        st.tuples(st.just("truncate"), st.floats(0, 1.2)),
        # A cut on a block boundary, where the old code went wrong.
        st.tuples(st.just("truncate_aligned"), st.sampled_from([0, 1])),
    ),
    min_size=1,
    max_size=6,
)


@given(ops=ops, seed=st.integers(0, 2**16))
@settings(
    max_examples=40,
    deadline=None,
    database=None,  # every run explores afresh; a failure prints its example
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_random_writes_and_cuts_keep_rollups_equal_to_brute_force(
    db: Database, ops: list[tuple[Any, ...]], seed: int
) -> None:
    job_id = new_job(db, worker_id=WORKER)
    appender = HeldAppender(db.engine, "property") if db.dialect == "postgresql" else None
    held: Held | None = None  # where the supervisor last left the history, as it believes
    rows: dict[int, StepRecord] = {}
    end = 0  # the next step a write appends
    for n, op in enumerate(ops):
        if op[0] in ("write", "held_write"):
            batch = synthetic_history(op[1], seed=seed + n, start=end)
            if op[0] == "write":
                write(db, job_id, batch, batch=2500)
                held = None
            else:
                held = held_write(db, appender, job_id, batch, held)
            rows |= {r.step: r for r in batch}
            end += op[1]
        elif op[0] == "rewrite" and rows:
            # A batch sent again after a lost acknowledgement: the same rows, the same values.
            first = int(op[1] * (end - 1))
            again = [rows[s] for s in range(first, min(end, first + op[2]))]
            write(db, job_id, again)
        elif op[0] == "truncate":
            cut = int(op[1] * end)
            truncate(db, job_id, cut)
            rows = {s: r for s, r in rows.items() if s < cut}
            end = min(end, cut)
        elif op[0] == "truncate_aligned":
            size = LEVEL_BLOCKS[op[1]]
            cut = (end // size) * size
            truncate(db, job_id, cut)
            rows = {s: r for s, r in rows.items() if s < cut}
            end = min(end, cut)
        # After every operation, not only at the end: a later write may hide a stale block.
        check_derived(db, job_id, [rows[s] for s in sorted(rows)])
    if appender is not None:
        appender.close()
    kept = [rows[s] for s in sorted(rows)]
    with db.read() as s:
        span = history.step_range(s, job_id)
        if kept:
            assert span == (kept[0].step, kept[-1].step)
            for points in (1, 3, 40):
                grid = rollups.grid_for(span[0], span[1], points)
                got = {
                    b.index: b
                    for b in rollups.buckets(s, job_id, lo=span[0], hi=span[1], points=points)
                }
                want = brute_force(kept, span[0], span[1], grid.origin, grid.width)
                assert sorted(got) == sorted(want)
                for index, b in got.items():
                    w = want[index]
                    assert (b.first_step, b.last_step, b.count, b.overflow_count) == (
                        w["first_step"],
                        w["last_step"],
                        w["count"],
                        w["overflow_count"],
                    )
                    assert b.nonfinite_loss_count == w["nonfinite_loss_count"]
                    assert _same(b.loss_min, w["loss_min"]) and _same(b.loss_max, w["loss_max"])
                    assert (b.scale_min, b.scale_max, b.scale_last) == (
                        w["scale_min"],
                        w["scale_max"],
                        w["scale_last"],
                    )
        else:
            assert span is None
