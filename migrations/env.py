"""Alembic environment. Run through ``halfway db upgrade`` (``service.database.migrate``), which
passes the URL in; ``alembic -c migrations/alembic.ini`` works too with HALFWAY_DATABASE_URL set."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection

from service.database.db import make_engine
from service.database.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode rebuilds tables when needed.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("HALFWAY_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set HALFWAY_DATABASE_URL")
    engine = make_engine(url)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported")
run_migrations_online()
