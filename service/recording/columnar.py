"""A job's history in columns: read straight into numpy arrays (no ORM object, no dict, on
PostgreSQL not even a Python tuple per row), then written out as columnar JSON, an Arrow IPC
stream or Parquet.

pyarrow is imported on the first Arrow or Parquet request only: it adds tens of megabytes to
a process, and an API that never exports should not carry them (``test_server_process.py``
checks that a fresh server has not loaded it).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import psycopg
from psycopg.adapt import Loader

from service.database.db import Database

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

MAX_STEP = 2**31 - 1
# Rows per database round trip and per Arrow record batch / Parquet row group: large enough
# that the per-query cost vanishes, small enough that a stream stays at a few megabytes.
CHUNK_ROWS = 131_072
ARROW_MEDIA_TYPE = "application/vnd.apache.arrow.stream"
PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"
EXPORT_MEDIA_TYPES = (ARROW_MEDIA_TYPE, PARQUET_MEDIA_TYPE)


@dataclass(frozen=True)
class Columns:
    """Rows in step order, one array per field. Losses and scales are float32, as the step
    table stores them (REAL); a NaN loss is NaN here (it is stored as NULL)."""

    step: np.ndarray[Any, np.dtype[np.int32]]
    epoch: np.ndarray[Any, np.dtype[np.int32]]
    loss: np.ndarray[Any, np.dtype[np.float32]]
    loss_scale: np.ndarray[Any, np.dtype[np.float32]]
    finite: np.ndarray[Any, np.dtype[np.bool_]]

    def __len__(self) -> int:
        return len(self.step)

    @classmethod
    def empty(cls) -> Columns:
        return cls(
            np.empty(0, np.int32),
            np.empty(0, np.int32),
            np.empty(0, np.float32),
            np.empty(0, np.float32),
            np.empty(0, np.bool_),
        )

    def in_step_order(self) -> Columns:
        """The same rows sorted by step. The queries return them in order already (a sorted
        subquery feeding ``array_agg``); this makes that a checked fact, not a hope."""
        if len(self) < 2 or bool(np.all(self.step[1:] > self.step[:-1])):
            return self
        order = np.argsort(self.step, kind="stable")
        return Columns(
            self.step[order],
            self.epoch[order],
            self.loss[order],
            self.loss_scale[order],
            self.finite[order],
        )


# --------------------------------------------------------------------------------------------
# Reading

# One row per query: each column as an array, and the first step past the range. A range of
# the primary key, not ORDER BY ... LIMIT: PostgreSQL then reads it with a bitmap scan, a
# third faster than walking the index, and returns heap order, which ``in_step_order`` checks
# (and repairs). COALESCE: NULL is how NaN is stored, and a REAL holds NaN, so every element
# has the same width and the arrays parse as fixed-size records.
_COLUMNS_PG = """
    SELECT array_agg(step), array_agg(epoch), array_agg(COALESCE(loss, 'NaN'::real)),
           array_agg(loss_scale), array_agg(finite),
           (SELECT min(step) FROM step
            WHERE job_id = %(job_id)s AND step > %(end)s AND step <= %(up_to)s)
    FROM step WHERE job_id = %(job_id)s AND step > %(after)s AND step <= %(end)s
"""
_COLUMNS_SQLITE = """
    SELECT step, epoch, loss, loss_scale, finite FROM step
    WHERE job_id = ? AND step > ? AND step <= ? ORDER BY step
"""
_NEXT_STEP_SQLITE = "SELECT min(step) FROM step WHERE job_id = ? AND step > ? AND step <= ?"
_SQLITE_FETCH = 65_536


@dataclass(frozen=True)
class Slice:
    """The rows of steps after_step+1 .. end, and the first recorded step after ``end`` (up
    to the requested bound), None when there is none."""

    columns: Columns
    end: int
    next_step: int | None


class _RawArray(Loader):
    """A binary array as its bytes: numpy parses them, instead of psycopg building a Python
    object per element."""

    format = psycopg.pq.Format.BINARY

    def load(self, data: Any) -> bytes:
        return bytes(data)


_ARRAY_OIDS = tuple(
    info.array_oid
    for info in (psycopg.postgres.types.get(name) for name in ("int4", "float4", "bool"))
    if info is not None
)


def _pg_array(data: bytes | None, element: str, out: str) -> np.ndarray[Any, Any]:
    """A one-dimensional binary array without NULLs: a 20-byte header (dimensions, null flag,
    element type, length, lower bound), then each element as a length and its big-endian
    value."""
    if data is None:  # array_agg over no rows
        return np.empty(0, out)
    ndim, has_null, _oid = struct.unpack_from(">iii", data)
    if ndim == 0:
        return np.empty(0, out)
    assert ndim == 1 and has_null == 0, "a step column came back with NULLs"
    (length,) = struct.unpack_from(">i", data, 12)
    items = np.frombuffer(data, [("size", ">i4"), ("value", element)], count=length, offset=20)
    return items["value"].astype(out)


def _read_pg(session: Session, job_id: int, after: int, end: int, up_to: int) -> Slice:
    raw = session.connection().connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    with raw.cursor(binary=True) as cursor:
        for oid in _ARRAY_OIDS:
            cursor.adapters.register_loader(oid, _RawArray)
        cursor.execute(_COLUMNS_PG, {"job_id": job_id, "after": after, "end": end, "up_to": up_to})
        row = cursor.fetchone()
    assert row is not None
    cols = Columns(
        _pg_array(row[0], ">i4", "int32"),
        _pg_array(row[1], ">i4", "int32"),
        _pg_array(row[2], ">f4", "float32"),
        _pg_array(row[3], ">f4", "float32"),
        _pg_array(row[4], "u1", "bool"),
    )
    return Slice(cols, end, row[5])


def _read_sqlite(session: Session, job_id: int, after: int, end: int, up_to: int) -> Slice:
    """sqlite3 hands out a tuple per row whatever one does; they are turned into arrays a
    block at a time, so a million-row page never holds a million tuples."""
    raw = session.connection().connection.driver_connection
    assert raw is not None
    cursor = raw.execute(_COLUMNS_SQLITE, (job_id, after, end))
    blocks: list[np.ndarray[Any, Any]] = []
    try:
        while rows := cursor.fetchmany(_SQLITE_FETCH):
            # float64 holds every int32 exactly; None (a NaN loss) becomes NaN.
            blocks.append(np.array(rows, dtype=np.float64).reshape(len(rows), 5))
        next_step = cursor.execute(_NEXT_STEP_SQLITE, (job_id, end, up_to)).fetchone()[0]
    finally:
        cursor.close()
    if not blocks:
        return Slice(Columns.empty(), end, next_step)
    table = np.concatenate(blocks)
    cols = Columns(
        table[:, 0].astype(np.int32),
        table[:, 1].astype(np.int32),
        table[:, 2].astype(np.float32),
        table[:, 3].astype(np.float32),
        table[:, 4] != 0,
    )
    return Slice(cols, end, next_step)


def read_columns(
    session: Session, job_id: int, *, after_step: int, limit: int, up_to: int | None = None
) -> Slice:
    """The rows of steps after_step+1 .. after_step+limit (and <= up_to), so at most
    ``limit`` rows, in step order: one query, one range of the primary key."""
    read = _read_pg if session.get_bind().dialect.name == "postgresql" else _read_sqlite
    bound = MAX_STEP if up_to is None else min(up_to, MAX_STEP)
    end = min(after_step + limit, bound)
    found = read(session, job_id, after_step, end, bound)
    return Slice(found.columns.in_step_order(), found.end, found.next_step)


def iter_columns(
    db: Database, job_id: int, *, lo: int, hi: int, chunk: int | None = None
) -> Iterator[Columns]:
    """Steps lo..hi in chunks, each read in its own short transaction (as the CSV export
    does): constant memory however long the job, and no snapshot held open while a slow
    client downloads."""
    chunk = CHUNK_ROWS if chunk is None else chunk
    after = lo - 1
    while after < hi:
        with db.read() as session:
            found = read_columns(session, job_id, after_step=after, limit=chunk, up_to=hi)
        if len(found.columns):
            yield found.columns
        if found.next_step is None:
            return
        after = found.next_step - 1  # over a gap in one step, however wide


# --------------------------------------------------------------------------------------------
# Columnar JSON


def _nonfinite_flag(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def columns_body(
    job_id: int,
    status: str,
    found: Slice,
    after_step: int,
    version: tuple[int, int | None] = (0, None),
) -> bytes:
    """A ColumnsPage as JSON: the shape uPlot takes. JSON has no NaN, so a non-finite loss is
    null with its kind in ``loss_nonfinite`` (as in the row pages). The cursor skips to just
    before the next recorded step, so a client never pages through a gap. ``version`` is the
    job's (history_version, history_reset_step), read before the rows as for row pages."""
    cols = found.columns
    loss: list[float | None] = cols.loss.astype(np.float64).tolist()
    flags: list[str | None] = [None] * len(cols)
    for i in np.flatnonzero(~np.isfinite(cols.loss)).tolist():
        flags[i] = _nonfinite_flag(loss[i])  # type: ignore[arg-type]
        loss[i] = None
    page = {
        "job_id": job_id,
        "status": status,
        "step": cols.step.tolist(),
        "epoch": cols.epoch.tolist(),
        "loss": loss,
        "loss_nonfinite": flags,
        "loss_scale": cols.loss_scale.astype(np.float64).tolist(),
        "finite": cols.finite.tolist(),
        "next_after_step": (
            found.next_step - 1
            if found.next_step is not None
            else int(cols.step[-1])
            if len(cols)
            else after_step
        ),
        "has_more": found.next_step is not None,
        "history_version": version[0],
        "history_reset_step": version[1],
    }
    return json.dumps(page, separators=(",", ":"), allow_nan=False).encode()


# --------------------------------------------------------------------------------------------
# Arrow and Parquet


def pyarrow() -> Any:
    """pyarrow, imported on first use (see the module's doc)."""
    import pyarrow

    return pyarrow


def arrow_schema(job_id: int) -> Any:
    pa = pyarrow()
    return pa.schema(
        [
            pa.field("step", pa.int32(), nullable=False),
            pa.field("epoch", pa.int32(), nullable=False),
            pa.field("loss", pa.float32(), nullable=False),  # NaN and +/-inf as themselves
            pa.field("loss_scale", pa.float32(), nullable=False),
            pa.field("finite", pa.bool_(), nullable=False),
        ],
        metadata={"halfway.job_id": str(job_id)},
    )


def record_batch(schema: Any, cols: Columns) -> Any:
    pa = pyarrow()
    return pa.record_batch(
        [
            pa.array(cols.step),
            pa.array(cols.epoch),
            pa.array(cols.loss),
            pa.array(cols.loss_scale),
            pa.array(cols.finite),
        ],
        schema=schema,
    )


class _Sink:
    """A write-only file that hands out what was written since the last ``take``."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.parts.append(chunk)
        return len(chunk)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


def _encode(
    chunks: Iterator[Columns], job_id: int, open_writer: Callable[[Any, Any], Any]
) -> Iterator[bytes]:
    schema = arrow_schema(job_id)
    return _write_batches(schema, (record_batch(schema, cols) for cols in chunks), open_writer)


def _write_batches(
    schema: Any, batches: Iterator[Any], open_writer: Callable[[Any, Any], Any]
) -> Iterator[bytes]:
    sink = _Sink()
    writer = open_writer(sink, schema)
    try:
        for batch in batches:
            writer.write_batch(batch)
            if out := sink.take():
                yield out
    finally:
        writer.close()
    if out := sink.take():
        yield out


def arrow_batches(schema: Any, batches: Iterator[Any]) -> Iterator[bytes]:
    """Record batches of any schema as an Arrow IPC stream, written out as they come."""
    pa = pyarrow()
    return _write_batches(schema, batches, lambda sink, sch: pa.ipc.new_stream(sink, sch))


def parquet_batches(schema: Any, batches: Iterator[Any]) -> Iterator[bytes]:
    """Record batches of any schema as a Parquet file, a row group per batch, uncompressed
    (as the history's)."""
    pyarrow()
    import pyarrow.parquet as pq

    return _write_batches(
        schema, batches, lambda sink, sch: pq.ParquetWriter(sink, sch, compression="none")
    )


def arrow_stream(chunks: Iterator[Columns], job_id: int) -> Iterator[bytes]:
    """An Arrow IPC stream: the schema, a record batch per chunk, the end-of-stream mark."""
    pa = pyarrow()
    return _encode(chunks, job_id, lambda sink, schema: pa.ipc.new_stream(sink, schema))


def parquet_stream(chunks: Iterator[Columns], job_id: int) -> Iterator[bytes]:
    """A Parquet file, a row group per chunk (written out as each is complete), the footer
    last."""
    pyarrow()
    import pyarrow.parquet as pq

    # No dictionary for step and loss (almost every value differs: a dictionary only costs
    # time, 3.6x the writing, and space); the other columns repeat and encode to a few bits.
    # No block compression: on these encodings snappy saved 2.5% of the bytes for twice the
    # time.
    return _encode(
        chunks,
        job_id,
        lambda sink, schema: pq.ParquetWriter(
            sink,
            schema,
            compression="none",
            use_dictionary=["epoch", "loss_scale", "finite"],
        ),
    )
