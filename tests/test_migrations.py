"""Alembic is the only source of the schema: upgrading an empty database gives exactly the
models, on both databases, and downgrading removes it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url

from service import jobs, migrate
from service.db import Database, normalize_url
from service.models import Base, utcnow
from service.schemas import JobSpec, SubmitResult

PG_URL = os.environ.get("HALFWAY_TEST_DATABASE_URL")


@pytest.fixture(params=["sqlite", "postgresql"] if PG_URL else ["sqlite"])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    assert PG_URL
    admin_url = make_url(normalize_url(PG_URL))
    name = f"halfway_mig_{uuid.uuid4().hex[:8]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_upgrade_empty_database_matches_models(empty_database: str) -> None:
    db = Database.connect(empty_database)
    migrate.upgrade(db.engine)
    with db.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(context, Base.metadata)
    db.dispose()
    assert diff == []


def test_downgrade_to_base_drops_everything_and_upgrade_again_works(empty_database: str) -> None:
    db = Database.connect(empty_database)
    migrate.upgrade(db.engine)
    migrate.downgrade(db.engine, "base")
    tables = set(inspect(db.engine).get_table_names()) - {"alembic_version"}
    assert tables == set()
    migrate.upgrade(db.engine)
    assert {"job", "step", "scale_event", "user", "sweep"} <= set(
        inspect(db.engine).get_table_names()
    )
    db.dispose()


def test_upgrade_twice_is_a_no_op(empty_database: str) -> None:
    db = Database.connect(empty_database)
    migrate.upgrade(db.engine)
    migrate.upgrade(db.engine)
    with db.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() is not None
    db.dispose()


def test_0002_drops_the_step_foreign_key_and_keeps_every_row(empty_database: str) -> None:
    db = Database.connect(empty_database)
    # The job is made by the models, which describe the head, then taken back to 0001.
    migrate.upgrade(db.engine)
    with db.write() as session:
        job_id = jobs.create_job(
            session,
            owner="ada",
            submitted=SubmitResult(spec=JobSpec(), warnings=[], notes=[]),
            now=utcnow(),
        ).id
    migrate.downgrade(db.engine, "0001")
    with db.engine.begin() as conn:
        conn.execute(
            text("INSERT INTO step VALUES (:j, :s, 0, :loss, 1024.0, :finite)"),
            [
                {"j": job_id, "s": s, "loss": None if s == 3 else 0.5 * s, "finite": s != 2}
                for s in range(5)
            ],
        )

    def foreign_keys() -> list[str]:
        return [fk["referred_table"] for fk in inspect(db.engine).get_foreign_keys("step")]

    def rows() -> list[tuple[object, ...]]:
        with db.engine.connect() as conn:
            return [
                tuple(r)
                for r in conn.execute(
                    text("SELECT job_id, step, loss, finite FROM step ORDER BY step")
                )
            ]

    before = rows()
    assert len(before) == 5 and foreign_keys() == ["job"]
    migrate.upgrade(db.engine)
    assert rows() == before and foreign_keys() == []
    if db.dialect == "sqlite":  # the table is still clustered on its key
        with db.engine.connect() as conn:
            sql = conn.execute(text("SELECT sql FROM sqlite_master WHERE name = 'step'")).scalar()
        assert "WITHOUT ROWID" in str(sql)
    migrate.downgrade(db.engine, "0001")
    assert rows() == before and foreign_keys() == ["job"]
    db.dispose()
