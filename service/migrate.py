"""Apply Alembic migrations programmatically (``halfway db upgrade``, and ``halfway serve``
and ``halfway worker`` on start).

Several processes may start at once on an empty database (API replicas, workers, a
migration job). Migrations therefore run under one lock: a transaction-scoped advisory lock
on PostgreSQL, a ``BEGIN IMMEDIATE`` transaction (the database's write lock) on SQLite. The
process that waited finds the schema at head and does nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, text

import migrations
from service.db import sqlite_begin_immediate

# pg_advisory_xact_lock's key for schema changes and first-start bootstrap ("halfway").
LOCK_KEY = 0x68616C66776179


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


def upgrade(engine: Engine, revision: str = "head") -> None:
    cfg = alembic_config(engine)
    with _locked(engine) as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    cfg = alembic_config(engine)
    with _locked(engine) as connection:
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, revision)
