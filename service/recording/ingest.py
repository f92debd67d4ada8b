"""The common history write on PostgreSQL: a batch that only appends (every step past the
job's last recorded one), which is what a running job sends every flush.

Such a batch cannot meet a stored row: the job's ``last_step`` is the greatest stored step
(only ``write_steps`` and ``truncate_after`` change either, each keeping them equal), and the
lease renewal that precedes the write holds the job's row locked, so no other writer of this
job can slip in. That lets the write skip what a general upsert needs:

- the scale of the step before the batch is the summary's ``loss_scale`` (no query);
- the rollups need not be recomputed from the stored rows: the batch's rows are all new, so
  each block's summary is the stored one merged with the batch's, at all three levels;
- the rows, the merged rollups, the scale events and the job's summary go in one statement,
  one round trip, its arrays built by numpy in PostgreSQL's binary format (no Python object
  per value on the way out).

Should a row be stored already after all, the statement stores only the new rows and
changes nothing else, and the caller takes the general path in ``history.write_steps``,
which recomputes from the rows and is idempotent.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import psycopg
from psycopg.adapt import Dumper
from sqlalchemy.orm.attributes import set_committed_value

from service.database.models import FLOAT32_MAX, Job, float32
from service.recording.rollups import LEVEL_BLOCKS

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from service.recording.records import StepRecord


MERGE_COLUMNS = (
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
_FLOAT_COLUMNS = {"loss_min", "loss_max", "loss_last", "scale_min", "scale_max", "scale_last"}
# The job summary's counters: the append path sets them, the held flush adds to them.
SUMMARY_COUNTERS = (
    "overflow_count",
    "nonfinite_loss_count",
    "growth_count",
    "backoff_count",
    "steps_recorded",
    "overflows_recorded",
    "backoffs_recorded",
)
_SUMMARY_COLUMNS = (
    "last_step",
    "epoch",
    "last_loss",
    "loss_scale",
    "min_loss_scale",
    *SUMMARY_COUNTERS,
    "steps_per_second",
    "updated_at",
)

# Floats travel as float4 arrays with NaN for NULL (NULLIF maps it back: PostgreSQL holds
# NaN equal to NaN), so every array is fixed-width. Every part after ``steps`` runs only when
# ``steps`` stored the whole batch. In DO UPDATE, ``r`` is the stored row before this
# statement; LEAST and GREATEST skip NULLs (a block with no finite loss yet).
# A stored block and a batch's summary of the same block, merged: exact only when none of the
# batch's rows is stored yet (both append paths make sure of that before they use it).
MERGE_ON_CONFLICT = """ON CONFLICT (job_id, level, block) DO UPDATE SET
    first_step = LEAST(r.first_step, excluded.first_step),
    last_step = GREATEST(r.last_step, excluded.last_step),
    count = r.count + excluded.count,
    loss_min = LEAST(r.loss_min, excluded.loss_min),
    loss_max = GREATEST(r.loss_max, excluded.loss_max),
    loss_last = CASE WHEN excluded.last_step > r.last_step
                     THEN excluded.loss_last ELSE r.loss_last END,
    scale_min = LEAST(r.scale_min, excluded.scale_min),
    scale_max = GREATEST(r.scale_max, excluded.scale_max),
    scale_last = CASE WHEN excluded.last_step > r.last_step
                      THEN excluded.scale_last ELSE r.scale_last END,
    overflow_count = r.overflow_count + excluded.overflow_count,
    nonfinite_loss_count = r.nonfinite_loss_count + excluded.nonfinite_loss_count"""
MERGE_VALUES = ", ".join(
    f"NULLIF(b.{c}, 'NaN'::real)" if c in _FLOAT_COLUMNS else f"b.{c}" for c in MERGE_COLUMNS
)
# The statement parts every PostgreSQL path shares. ``source`` joins each to what gates it
# (the append's ``whole``, the held flush's ``lease``) or is empty.


def insert_steps(source: str = "") -> str:
    """INSERT the batch's rows, sent as five binary arrays (``array_param``)."""
    return f"""INSERT INTO step (job_id, step, epoch, loss, loss_scale, finite)
        SELECT %(job_id)s, t.step, t.epoch, NULLIF(t.loss, 'NaN'::real), t.loss_scale, t.finite
        FROM unnest(%(step)b, %(epoch)b, %(loss)b, %(loss_scale)b, %(finite)b)
             AS t(step, epoch, loss, loss_scale, finite){source}"""


def insert_events(source: str) -> str:
    """INSERT the batch's scale events (``scale_changes``), four binary arrays."""
    return f"""INSERT INTO scale_event (job_id, step, old_scale, new_scale, reason)
        SELECT %(job_id)s, e.step, e.old_scale, e.new_scale,
               CASE WHEN e.growth THEN 'growth' ELSE 'overflow' END
        FROM unnest(%(ev_step)b, %(ev_old)b, %(ev_new)b, %(ev_growth)b)
             AS e(step, old_scale, new_scale, growth){source}
        ON CONFLICT (job_id, step) DO UPDATE SET old_scale = excluded.old_scale,
            new_scale = excluded.new_scale, reason = excluded.reason"""


def merge_rollups(source: str) -> str:
    """Merge the batch's block summaries (``block_params``) into the stored ones."""
    return f"""INSERT INTO step_rollup AS r (job_id, {", ".join(MERGE_COLUMNS)})
        SELECT %(job_id)s, {MERGE_VALUES}
        FROM unnest({", ".join(f"%(r_{c})b" for c in MERGE_COLUMNS)})
             AS b({", ".join(MERGE_COLUMNS)}){source}
        {MERGE_ON_CONFLICT}"""


# Only rows not stored yet; ``whole`` says whether that was every row of the batch.
INSERT_NEW_STEPS = insert_steps() + " ON CONFLICT (job_id, step) DO NOTHING"
_ROWS_PG = f"""
    steps AS (
        {INSERT_NEW_STEPS}
        RETURNING 1
    ), whole AS (
        SELECT count(*) = %(rows)s AS ok FROM steps
    ),
"""
_SUMMARIES_PG = f"""
    events AS (
        {insert_events(", whole WHERE whole.ok")}
    ), rollups AS (
        {merge_rollups(", whole WHERE whole.ok")}
    )
    UPDATE job SET {", ".join(f"{c} = %(j_{c})s" for c in _SUMMARY_COLUMNS)}
    FROM whole, (SELECT set_config('synchronous_commit', %(synchronous_commit)s, true)) AS cfg
    WHERE job.id = %(job_id)s AND whole.ok
    RETURNING 1
"""


# The rows and everything else in one statement; or everything else, for a batch that went in
# by COPY (``COPY_ROWS``).
_APPEND_PG = "WITH" + _ROWS_PG + _SUMMARIES_PG
_MERGE_PG = "WITH whole AS (SELECT true AS ok)," + _SUMMARIES_PG
COPY_STEPS = "COPY step (job_id, step, epoch, loss, loss_scale, finite) FROM STDIN (FORMAT BINARY)"
# From this many rows a batch goes in by binary COPY (PostgreSQL's multi-row insert) in a
# savepoint, before the statement: three more round trips, less work per row (at 10,000 rows
# 1.6x the steps/s of the INSERT; at 333 the two were within noise of each other).
COPY_ROWS = 1000

# A binary COPY row of the step table: a field count, then each field's length and value
# (big-endian). A NaN loss is a NULL (length -1, no value), so such a row is 4 bytes shorter.
_COPY_ROW = np.dtype(
    [
        ("fields", ">i2"),
        ("job_id_size", ">i4"),
        ("job_id", ">i4"),
        ("step_size", ">i4"),
        ("step", ">i4"),
        ("epoch_size", ">i4"),
        ("epoch", ">i4"),
        ("loss_size", ">i4"),
        ("loss", ">f4"),
        ("scale_size", ">i4"),
        ("scale", ">f4"),
        ("finite_size", ">i4"),
        ("finite", "u1"),
    ]
)
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack(">ii", 0, 0)
_COPY_TRAILER = struct.pack(">h", -1)
_LOSS_VALUE = 2 + 3 * 8 + 4  # the loss's value: after the count, three fields and its size
_AFTER_LOSS = _LOSS_VALUE + 4


def _copy_payload(job_id: int, values: Any) -> bytes:
    """The batch (an n x 5 array: step, epoch, loss, scale, finite) in COPY's binary format,
    built in a few array operations rather than a Python call per row."""
    rows = np.zeros(len(values), _COPY_ROW)
    rows["fields"] = 6
    for name in ("job_id", "step", "epoch", "loss", "scale"):
        rows[f"{name}_size"] = 4
    rows["finite_size"] = 1
    rows["job_id"] = job_id
    rows["step"] = values[:, 0]
    rows["epoch"] = values[:, 1]
    rows["loss"] = values[:, 2]
    rows["scale"] = values[:, 3]
    rows["finite"] = values[:, 4] != 0
    nan = np.flatnonzero(np.isnan(values[:, 2])).tolist()
    if not nan:
        return _COPY_HEADER + rows.tobytes() + _COPY_TRAILER
    rows["loss_size"][nan] = -1
    parts, start = [_COPY_HEADER], 0
    for i in nan:
        parts.append(rows[start:i].tobytes())
        row = rows[i : i + 1].tobytes()
        parts.append(row[:_LOSS_VALUE] + row[_AFTER_LOSS:])  # a NULL has no value
        start = i + 1
    parts += [rows[start:].tobytes(), _COPY_TRAILER]
    return b"".join(parts)


def copy_steps(raw: psycopg.Connection[Any], job_id: int, values: Any) -> bool:
    """The batch (``step_values``) into the step table by binary COPY, in a savepoint: COPY
    cannot skip conflicts, so a batch that meets a stored row stores nothing and this
    returns False (the savepoint is rolled back)."""
    try:
        with raw.transaction(), raw.cursor() as cursor, cursor.copy(COPY_STEPS) as copy:
            copy.write(_copy_payload(job_id, values))
    except psycopg.errors.UniqueViolation:
        return False
    return True


def insert_new_steps(raw: psycopg.Connection[Any], job_id: int, values: Any) -> None:
    """The batch's rows not stored yet, in one statement (for a batch COPY refused)."""
    with raw.cursor() as cursor:
        for cls, dumper in DUMPERS:
            cursor.adapters.register_dumper(cls, dumper)
        cursor.execute(INSERT_NEW_STEPS, {"job_id": job_id, **row_params(values)})


def row_params(values: Any) -> dict[str, bytes]:
    """The batch's columns as the binary arrays ``insert_steps`` reads."""
    return {
        "step": array_param("int4", values[:, 0]),
        "epoch": array_param("int4", values[:, 1]),
        "loss": array_param("float4", values[:, 2]),
        "loss_scale": array_param("float4", values[:, 3]),
        "finite": array_param("bool", values[:, 4] != 0),
    }


def scale_changes(values: Any, previous: float | None) -> tuple[Any, Any, Any]:
    """The one rule of scale events: each step whose scale differs from the step before's
    (a fall follows an overflow, a rise is growth). ``values`` is the batch
    (``step_values``); ``previous`` the scale of the step before its first, or None when
    that is unknown (then the first step starts no event). Returns the changed rows'
    indexes, their old scales and their new ones."""
    scales = values[:, 3]
    before = np.empty_like(scales)
    before[1:] = scales[:-1]
    if previous is not None:
        before[0] = previous
        changed = np.flatnonzero(scales != before)
    else:
        changed = np.flatnonzero(scales[1:] != before[1:]) + 1
    return changed, before[changed], scales[changed]


def event_params(values: Any, changes: tuple[Any, Any, Any]) -> dict[str, bytes]:
    """The batch's scale events (``scale_changes(values, ...)``) as the binary arrays
    ``insert_events`` reads."""
    changed, old, new = changes
    return {
        "ev_step": array_param("int4", values[changed, 0]),
        "ev_old": array_param("float4", old),
        "ev_new": array_param("float4", new),
        "ev_growth": array_param("bool", ~(new < old)),
    }


class _BinaryArray(Dumper):
    """Sends a ready-made binary array (``array_param``) as it is."""

    format = psycopg.pq.Format.BINARY

    def dump(self, obj: Any) -> bytes:
        return bytes(obj)


class _Int4Array(bytes):
    pass


class _Float4Array(bytes):
    pass


class _BoolArray(bytes):
    pass


_ARRAY_TYPES: dict[str, tuple[type[bytes], str]] = {
    "int4": (_Int4Array, ">i4"),
    "float4": (_Float4Array, ">f4"),
    "bool": (_BoolArray, "u1"),
}
DUMPERS: list[tuple[type[bytes], type[Dumper]]] = []
for _name, (_cls, _) in _ARRAY_TYPES.items():
    _info = psycopg.postgres.types.get(_name)
    assert _info is not None
    DUMPERS.append((_cls, type(f"_{_name}ArrayDumper", (_BinaryArray,), {"oid": _info.array_oid})))


def array_param(kind: str, values: Any) -> bytes:
    """A one-dimensional array without NULLs in PostgreSQL's binary format: dimensions, null
    flag, element type, then length and lower bound, then each element's size and value."""
    cls, element = _ARRAY_TYPES[kind]
    info = psycopg.postgres.types.get(kind)
    assert info is not None
    data = np.asarray(values)
    if len(data) == 0:
        return cls(struct.pack(">iii", 0, 0, info.oid))
    items = np.empty(len(data), [("size", ">i4"), ("value", element)])
    items["size"] = np.dtype(element).itemsize
    items["value"] = data
    return cls(struct.pack(">iiiii", 1, 0, info.oid, len(data), 1) + items.tobytes())


def appends(session: Session, job: Job, records: Sequence[StepRecord]) -> bool:
    """Whether this batch may take the append path (see the module's doc)."""
    if session.get_bind().dialect.name != "postgresql":
        return False
    if job.last_step is not None and records[0].step <= job.last_step:
        return False
    steps = [r.step for r in records]
    return all(a < b for a, b in itertools.pairwise(steps))


def step_values(records: Sequence[StepRecord]) -> Any:
    """The batch as an n x 5 float64 array (step, epoch, loss, scale, finite): one pass over
    the records' fields, without the per-row sequence checks of ``np.array``."""
    flat = np.fromiter(itertools.chain.from_iterable(records), np.float64, 5 * len(records))
    return flat.reshape(len(records), 5)


def block_params(values: Any) -> dict[str, bytes]:
    """The batch's summary of each block it touches, at every level, as one binary array per
    column (``MERGE_COLUMNS``, as ``r_<column>``), by numpy. The steps increase, so each
    block's rows are one run; the rows are laid out once per level, end to end, so that one
    ``reduceat`` per column summarizes every block of every level."""
    n = len(values)
    steps = values[:, 0].astype(np.int64)
    loss, scale = values[:, 2], values[:, 3]
    finite_loss = np.abs(loss) <= FLOAT32_MAX  # False for NaN and +/-inf
    levels = len(LEVEL_BLOCKS)
    block = np.concatenate([steps // size for size in LEVEL_BLOCKS])
    cut = np.empty(levels * n, dtype=bool)
    cut[0] = True
    np.not_equal(block[1:], block[:-1], out=cut[1:])
    cut[n::n] = True  # each level's first row starts a block, whatever its number
    starts = np.flatnonzero(cut)
    ends = np.append(starts[1:], levels * n) - 1
    first, last = starts % n, ends % n

    def tiled(column: Any) -> Any:
        return np.tile(column, levels)

    finite_losses = tiled(np.where(finite_loss, loss, np.nan))  # fmin and fmax skip NaN
    scales = tiled(scale)
    columns: dict[str, Any] = {
        "level": starts // n,
        "block": block[starts],
        "first_step": steps[first],
        "last_step": steps[last],
        "count": ends - starts + 1,
        "loss_min": np.fmin.reduceat(finite_losses, starts),  # NaN: no finite loss
        "loss_max": np.fmax.reduceat(finite_losses, starts),
        "loss_last": loss[last],
        "scale_min": np.minimum.reduceat(scales, starts),
        "scale_max": np.maximum.reduceat(scales, starts),
        "scale_last": scale[last],
        "overflow_count": np.add.reduceat(tiled(values[:, 4] == 0).astype(np.int64), starts),
        "nonfinite_loss_count": np.add.reduceat(tiled(~finite_loss).astype(np.int64), starts),
    }
    return {
        f"r_{name}": array_param("float4" if name in _FLOAT_COLUMNS else "int4", column)
        for name, column in columns.items()
    }


def previous_scale(last_step: int | None, loss_scale: float | None, first: int) -> float | None:
    """The scale of step ``first - 1`` on an append path, from the summary a writer holds
    (as the step table holds it, a float32): None when that step is not the last one
    written."""
    if last_step is None or last_step != first - 1 or loss_scale is None:
        return None
    return float32(loss_scale)


def append_pg(
    session: Session,
    job: Job,
    records: Sequence[StepRecord],
    summary: dict[str, Any],
    *,
    durable: bool = True,
) -> bool:
    """Write an appending batch (``appends`` said yes) with its scale events and the job's
    new ``summary`` (column values). False if a row was stored already: then only the new
    rows were written, and the caller must take the general path. ``durable=False`` lets
    the commit return before the disk has the transaction (``history.relax_commit``), set
    by the same statement rather than a round trip of its own."""
    values = step_values(records)
    copied = len(records) >= COPY_ROWS
    params: dict[str, Any] = {"job_id": job.id, "synchronous_commit": "on" if durable else "off"}
    if not copied:
        params |= {"rows": len(records), **row_params(values)}
    previous = previous_scale(job.last_step, job.loss_scale, records[0].step)
    params |= event_params(values, scale_changes(values, previous))
    params |= block_params(values)
    params |= {f"j_{c}": summary.get(c, getattr(job, c)) for c in _SUMMARY_COLUMNS}
    if params["j_last_loss"] is not None and math.isnan(params["j_last_loss"]):
        params["j_last_loss"] = None  # NanAsNullReal
    raw = session.connection().connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    if copied and not copy_steps(raw, job.id, values):
        return False  # nothing of the batch is stored
    with raw.cursor() as cursor:
        for cls, dumper in DUMPERS:
            cursor.adapters.register_dumper(cls, dumper)
        cursor.execute(_MERGE_PG if copied else _APPEND_PG, params)
        whole = cursor.fetchone() is not None
    if whole:  # the row holds these values now; the session must not write them again
        for name, value in summary.items():
            set_committed_value(job, name, value)
    return whole
