"""The worker's flush in one statement on PostgreSQL: the fenced lease renewal, the rows, the
rollups, the scale events and the summary, on a connection of the worker's own in
autocommit, one round trip (``HeldAppender``). It builds on the append path's statement
parts and binary arrays (``service.recording.ingest``); anything it cannot take goes to the general
path in ``service.recording.history``."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import psycopg

from service.database.models import Job
from service.recording.ingest import (
    COPY_ROWS,
    DUMPERS,
    SUMMARY_COUNTERS,
    block_params,
    event_params,
    insert_events,
    insert_steps,
    merge_rollups,
    previous_scale,
    row_params,
    scale_changes,
    step_values,
)

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from service.recording.records import StepRecord

# The worker's flush in one statement: the fenced lease renewal, the rows, the rollups, the
# scale events and the summary, run on a connection of the worker's own in autocommit (so the
# statement is its own transaction: no BEGIN, no COMMIT, no pool check-out), one round trip.
#
# The job's UPDATE renews the lease and writes the summary at once (a statement cannot update
# one row twice), and runs only if the worker holds the lease and the job's history ends where
# the worker last left it (``Held``): then every row of the batch is new (``last_step`` is the
# greatest stored step) and the rollups can be merged and the counters added to. Everything
# else reads ``lease``, so a worker that lost the lease, or a history that moved (a database
# crash took back relaxed commits, a truncation), writes nothing and the caller takes the
# general path. The rows are a plain INSERT: should one be stored after all, the statement
# fails as a whole and changes nothing.
_HELD_APPEND_PG = f"""
    WITH lease AS (
        UPDATE job SET
            lease_expires_at = now() + %(lease_seconds)s::float8 * INTERVAL '1 second',
            updated_at = now(),
            last_step = %(j_last_step)s::int4,
            epoch = %(j_epoch)s::int4,
            last_loss = %(j_last_loss)s::float4,
            loss_scale = %(j_loss_scale)s::float8,
            min_loss_scale = LEAST(min_loss_scale, %(j_min_loss_scale)s::float8),
            {", ".join(f"{c} = {c} + %(d_{c})s::int4" for c in SUMMARY_COUNTERS)},
            steps_per_second = COALESCE(%(j_steps_per_second)s::float8, steps_per_second)
        FROM (SELECT set_config('synchronous_commit', %(synchronous_commit)s, true)) AS cfg
        WHERE id = %(job_id)s::int4 AND worker_id = %(worker_id)s AND status = 'running'
          AND last_step IS NOT DISTINCT FROM %(held_last_step)s::int4
          AND loss_scale IS NOT DISTINCT FROM %(held_loss_scale)s::float8
        RETURNING cancel_requested, last_step, loss_scale
    ), steps AS (
        {insert_steps(", lease")}
    ), events AS (
        {insert_events(", lease")}
    ), rollups AS (
        {merge_rollups(", lease")}
    )
    SELECT cancel_requested, last_step, loss_scale FROM lease
"""
# One space for each run of whitespace: psycopg caches its parsing of a query only up to
# ``psycopg._queries.MAX_CACHED_STATEMENT_LENGTH`` characters, and parsing this one again for
# each flush cost as much as building its arrays.
_HELD_APPEND_PG = re.sub(r"\s+", " ", _HELD_APPEND_PG).strip()


@dataclass(frozen=True)
class Held:
    """Where a job's history ended when its writer last wrote it (or loaded it): its last
    step and the scale of that step, as the job's summary holds them."""

    last_step: int | None
    loss_scale: float | None

    @classmethod
    def of(cls, job: Job) -> Held:
        return cls(job.last_step, job.loss_scale)


@dataclass(frozen=True)
class HeldWrite:
    """A batch written by ``HeldAppender``: whether a cancel was asked for, and where the
    history ends now."""

    cancel_requested: bool
    held: Held


class HeldAppender:
    """The worker's connection for ``_HELD_APPEND_PG``: its own, in autocommit, opened on
    first use. A connection found dead (the server restarted, an idle connection was cut)
    is replaced and the statement sent once more: if the first one committed before its
    answer was lost, the second finds the history moved and writes nothing."""

    def __init__(self, engine: Engine, name: str) -> None:
        cargs, cparams = engine.dialect.create_connect_args(engine.url)
        cparams.pop("context", None)  # SQLAlchemy's adapters; this connection has its own
        cparams.setdefault("application_name", name[:63])
        self._cargs, self._cparams = cargs, cparams
        self._conn: psycopg.Connection[Any] | None = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(*self._cargs, autocommit=True, **self._cparams)
            for cls, dumper in DUMPERS:
                conn.adapters.register_dumper(cls, dumper)
            self._conn = conn
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def append(
        self,
        *,
        job_id: int,
        worker_id: str,
        lease_seconds: float,
        held: Held,
        records: Sequence[StepRecord],
        steps_per_second: float | None,
        durable: bool,
    ) -> HeldWrite | None:
        """Renew the lease and write the batch in one statement. None if nothing was
        written: the batch does not only append (its steps must increase, all past where
        ``held`` says the history ends, and be fewer than ``COPY_ROWS``: larger batches go in
        by COPY), the lease is not ours, or the history is not where ``held`` says. The
        caller then takes the general path, which tells these apart. Raises
        ``psycopg.OperationalError`` if the database cannot be reached."""
        params = _held_params(held, records, steps_per_second)
        if params is None:
            return None
        params |= {
            "job_id": job_id,
            "worker_id": worker_id,
            "lease_seconds": float(lease_seconds),
            "synchronous_commit": "on" if durable else "off",
        }
        while True:
            reused = self._conn is not None and not self._conn.closed
            try:
                row = self._connection().execute(_HELD_APPEND_PG, params).fetchone()
                break
            except psycopg.errors.UniqueViolation:
                return None  # a row stored behind the summary's back: nothing was written
            except psycopg.OperationalError:
                conn = self._conn
                if conn is not None and not conn.closed and not conn.broken:
                    raise  # an answer from a live server, not a dead connection
                self.close()
                if not reused:
                    raise  # a connection just opened failed: the server is away
        if row is None:
            return None
        return HeldWrite(bool(row[0]), Held(row[1], row[2]))


def _held_params(
    held: Held, records: Sequence[StepRecord], steps_per_second: float | None
) -> dict[str, Any] | None:
    """The statement's parameters but the lease's: the batch's columns, events and block
    summaries as binary arrays, the summary's new values and what each counter grows by.
    None if the batch does not only append."""
    if not records or len(records) >= COPY_ROWS:
        return None
    if held.last_step is not None and records[0].step <= held.last_step:
        return None
    values = step_values(records)
    if not np.all(np.diff(values[:, 0]) > 0):
        return None
    previous = previous_scale(held.last_step, held.loss_scale, records[0].step)
    changes = scale_changes(values, previous)
    changed, old, new = changes
    growths = int(np.count_nonzero(~(new < old)))
    backoffs = len(changed) - growths
    overflows = int(len(records) - np.count_nonzero(values[:, 4]))
    last = records[-1]
    params: dict[str, Any] = {
        "held_last_step": held.last_step,
        "held_loss_scale": held.loss_scale,
        "j_last_step": last.step,
        "j_epoch": last.epoch,
        "j_last_loss": None if math.isnan(last.loss) else last.loss,  # NanAsNullReal
        "j_loss_scale": last.loss_scale,
        "j_min_loss_scale": float(values[:, 3].min()),
        "j_steps_per_second": steps_per_second,
        "d_overflow_count": overflows,
        "d_nonfinite_loss_count": int(np.count_nonzero(~np.isfinite(values[:, 2]))),
        "d_growth_count": growths,
        "d_backoff_count": backoffs,
        "d_steps_recorded": len(records),
        "d_overflows_recorded": overflows,
        "d_backoffs_recorded": backoffs,
        **row_params(values),
        **event_params(values, changes),
    }
    return params | block_params(values)
