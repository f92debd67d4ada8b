"""The database's clock, as a SQL expression: leases are compared with times other hosts
wrote, so they must all come from one clock, the database's, never a worker's.

PostgreSQL: ``now()`` (the transaction's start). SQLite: ``'now'`` in the exact text form
SQLAlchemy stores datetimes in (``YYYY-MM-DD HH:MM:SS.ffffff``), because SQLite compares
datetimes as text; its clock is the host's, which every process using the file shares.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Float, literal
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from service.database.models import UTCDateTime


class db_now(FunctionElement[datetime]):  # lower case: it reads as the SQL function it is
    """The database's current time plus ``seconds`` (which may be negative)."""

    type = UTCDateTime()
    inherit_cache = True
    name = "halfway_db_now"

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(literal(float(seconds), Float()))


def _seconds(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    (seconds,) = element.clauses
    return compiler.process(seconds, **kw)


@compiles(db_now, "postgresql")
def _postgresql(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = _seconds(element, compiler, **kw)
    return f"(now() + CAST({seconds} AS DOUBLE PRECISION) * INTERVAL '1 second')"


@compiles(db_now, "sqlite")
def _sqlite(element: db_now, compiler: SQLCompiler, **kw: Any) -> str:
    # %f is seconds with milliseconds; three zeros make the microseconds SQLAlchemy writes,
    # so a text comparison with stored values orders by time.
    seconds = _seconds(element, compiler, **kw)
    return f"strftime('%Y-%m-%d %H:%M:%f000', 'now', ({seconds}) || ' seconds')"
