"""Apply Alembic migrations programmatically (``halfway db upgrade``, and ``halfway serve``
and ``halfway worker`` on start).

Several processes may start at once on an empty database (API replicas, workers, a
migration job). Migrations therefore run under one lock: a transaction-scoped advisory lock
on PostgreSQL, a ``BEGIN IMMEDIATE`` transaction (the database's write lock) on SQLite. The
process that waited finds the schema at head and does nothing.

Alembic's own INFO lines are silenced; each step applied is logged as one line instead
(``database upgraded to 0007 (Rollup levels ...)``), and nothing when there was nothing to do."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from sqlalchemy import Connection, Engine, text

import migrations
from service.database.db import sqlite_begin_immediate

# pg_advisory_xact_lock's key for schema changes and first-start bootstrap ("halfway").
LOCK_KEY = 0x68616C66776179

# One line per step says what matters; Alembic's own lines are quieted by service.logs.
log = logging.getLogger("halfway.migrate")


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    return cfg


def hold_lock(connection: Connection) -> None:
    """Take the schema lock for the rest of ``connection``'s transaction. On SQLite a write
    transaction (BEGIN IMMEDIATE) already holds the only lock there is."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK_KEY})


@contextmanager
def _locked(engine: Engine) -> Iterator[Connection]:
    with sqlite_begin_immediate(engine).begin() as connection:
        hold_lock(connection)
        yield connection


def upgrade(engine: Engine, revision: str = "head") -> list[Script]:
    """Bring the schema to ``revision``; the steps applied, oldest first (none at head)."""
    cfg = alembic_config(engine)
    with _locked(engine) as connection:
        before = _heads(connection)
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)
        after = _heads(connection)
    steps = list(reversed(list(ScriptDirectory.from_config(cfg).iterate_revisions(after, before))))
    for step in steps:
        log.info("database upgraded to %s (%s)", step.revision, _title(step))
    return steps


def downgrade(engine: Engine, revision: str) -> list[Script]:
    """Undo the steps above ``revision``; those undone, newest first."""
    cfg = alembic_config(engine)
    with _locked(engine) as connection:
        before = _heads(connection)
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, revision)
        after = _heads(connection)
    steps = list(ScriptDirectory.from_config(cfg).iterate_revisions(before, after))
    for step in steps:
        log.info("database downgraded: undid %s (%s)", step.revision, _title(step))
    return steps


def _heads(connection: Connection) -> tuple[str, ...]:
    return MigrationContext.configure(connection).get_current_heads()


def _title(step: Script) -> str:
    """The first sentence of the step's docstring, on one line and short."""
    words = " ".join((step.doc or "").split())
    title = words.split(". ")[0].rstrip(".")
    if len(title) > 60:
        title = title[:60].rsplit(" ", 1)[0]
        if title.count("(") > title.count(")"):
            title = title[: title.rindex("(")]
        title = title.rstrip(" ,;:") + " ..."
    return title
