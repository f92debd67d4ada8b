"""Engine and session factories for SQLite and PostgreSQL.

SQLite needs care to behave under several writers (API requests, a worker writing history):
- WAL so readers never block the writer, and a busy timeout so writers queue instead of failing;
- pysqlite's own transaction handling is switched off and we emit BEGIN ourselves, because a
  deferred transaction that reads and then writes can fail with SQLITE_BUSY without waiting
  (its snapshot is stale). Write sessions therefore start with ``BEGIN IMMEDIATE``, which takes
  the write lock up front and waits for it (the design's claim transaction needs exactly this).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, Table, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 30_000
_BEGIN_OPTION = "halfway_sqlite_begin"


def normalize_url(url: str) -> str:
    """Accept the ``postgresql://`` form people copy from psql and use psycopg 3 for it."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


# As many connections as the API's worker threads (AnyIO's default 40), so a burst of polls
# never churns through opening and closing overflow connections.
POOL_SIZE = 40


def make_engine(url: str, *, pool_size: int = POOL_SIZE) -> Engine:
    url = normalize_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            # Pooled: opening a connection (and its PRAGMAs) per request costs more than the
            # query a polling dashboard makes. Every transaction ends before check-in, so a
            # pooled connection never pins an old WAL snapshot.
            pool_size=pool_size,
            max_overflow=10,
        )
        _configure_sqlite(engine)
        return engine
    # PostgreSQL's default max_connections is 100: a replica keeps at most 15 open when idle.
    return create_engine(url, pool_size=15, max_overflow=pool_size - 15, pool_pre_ping=True)


def _power(base: float | None, exponent: float | None) -> float | None:
    if base is None or exponent is None:
        return None
    return math.pow(base, exponent)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves (see module doc)
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()
        # power() is built into SQLite only where it was compiled with its math functions,
        # and a process binds to whichever SQLite it loads first (TensorFlow ships one
        # without them): the fair-share decay brings its own.
        dbapi_connection.create_function("power", 2, _power, deterministic=True)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")


def sqlite_begin_immediate(engine: Engine) -> Engine:
    """The engine, its transactions taking SQLite's write lock at BEGIN (a no-op elsewhere)."""
    return engine.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})


@dataclass(frozen=True)
class Database:
    """The engine and two session factories: plain (reads), and write (BEGIN IMMEDIATE on
    SQLite)."""

    engine: Engine
    sessions: sessionmaker[Session]
    write_sessions: sessionmaker[Session]

    @classmethod
    def connect(cls, url: str) -> Database:
        engine = make_engine(url)
        write_bind = sqlite_begin_immediate(engine)
        return cls(
            engine=engine,
            sessions=sessionmaker(bind=engine, expire_on_commit=False),
            write_sessions=sessionmaker(bind=write_bind, expire_on_commit=False),
        )

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A write transaction: committed on success, rolled back on any exception."""
        with self.write_sessions() as session, session.begin():
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        with self.sessions() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


def upsert(session: Session, table: Table, rows: list[dict[str, Any]], keys: list[str]) -> None:
    """INSERT ... ON CONFLICT (keys) DO UPDATE, in either dialect's form."""
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(table)
    stmt = stmt.on_conflict_do_update(
        index_elements=keys,
        set_={c.name: stmt.excluded[c.name] for c in table.columns if c.name not in keys},
    )
    session.execute(stmt, rows)
