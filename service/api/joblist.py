"""The job list's rows, read as the database holds them (JSON columns as their text), so
that a job that has not changed since the last reload is recognized without decoding its
spec or encoding it again (``PollCache.item``): a dashboard's hundred jobs are reloaded at
every cache age while one of them, the running one, changes."""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from typing import Any

from sqlalchemy import JSON, ColumnElement, Row, Text, cast, select
from sqlalchemy.orm import Session

from service.database.models import Job

# Every column of a job, by attribute name: all of them, not only those ``job_out`` reads,
# so that a column it comes to read can never be missed by the fingerprint.
_ATTRS = tuple(Job.__mapper__.column_attrs)
_JSON = frozenset(a.key for a in _ATTRS if isinstance(a.columns[0].type, JSON))
_SELECTED: tuple[ColumnElement[Any], ...] = tuple(
    (cast(a.columns[0], Text) if a.key in _JSON else a.columns[0]).label(a.key) for a in _ATTRS
)


def list_rows(
    session: Session,
    *,
    status: str | None = None,
    owner: str | None = None,
    before_id: int | None = None,
    limit: int = 50,
) -> tuple[Sequence[Row[Any]], int | None]:
    """A page of the list, newest first, and the cursor of the next one (the last id of this
    page). One row more than ``limit`` is read: it tells whether there is a next page."""
    query = select(*_SELECTED).order_by(Job.id.desc()).limit(limit + 1)
    if status is not None:
        query = query.where(Job.status == status)
    if owner is not None:
        query = query.where(Job.owner == owner)
    if before_id is not None:
        query = query.where(Job.id < before_id)
    rows = session.execute(query).all()
    next_cursor: int | None = rows[limit - 1].id if len(rows) > limit else None
    return rows[:limit], next_cursor


def fingerprint(row: Row[Any]) -> bytes:
    """The row's values as bytes that tell apart whatever its JSON would: unlike ``==``,
    ``-0.0`` is not ``0.0``, and the JSON columns are compared as the text they are stored
    as. Pickled only to be compared, never loaded."""
    return pickle.dumps(tuple(row), protocol=5)


def job_of(row: Row[Any]) -> Job:
    """The row as a (transient) ``Job``, its JSON decoded as the ORM would decode it."""
    values = row._asdict()
    for key in _JSON:
        text = values[key]
        values[key] = None if text is None else json.loads(text)
    return Job(**values)
