"""Alembic is the only source of the schema: upgrading an empty database gives exactly the
models, on both databases, and downgrading removes it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import MetaData, Table, create_engine, insert, inspect, text
from sqlalchemy.engine import make_url

from service.api.app import create_app
from service.database import migrate
from service.database.db import Database, normalize_url
from service.database.models import Base, Job, utcnow
from service.recording import history, rollups
from service.settings import Settings
from tests.conftest import Api
from tests.test_history_queries import check_buckets, synthetic_history

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


def add_job_at_an_older_revision(db: Database, **values: Any) -> int:
    """A job row in the columns the job table has at the database's (older) revision: the ORM
    model is the head's and would write columns that do not exist yet."""
    now = utcnow()
    row: dict[str, Any] = {
        "owner": "ada",
        "name": "job",
        "status": "queued",
        "spec": {},
        "warnings": [],
        "notes": [],
        "priority": 50,
        "attempt": 0,
        "max_attempts": 3,
        "cancel_requested": False,
        "attempt_errors": [],
        "created_at": now,
        "updated_at": now,
        "overflow_count": 0,
        "growth_count": 0,
        "backoff_count": 0,
        "nonfinite_loss_count": 0,
        "metrics": {},
        "precision_report": [],
        "forensics": [],
        "device": {},
        **values,
    }
    with db.engine.begin() as conn:
        table = Table("job", MetaData(), autoload_with=conn)
        return int(conn.execute(insert(table).values(row).returning(table.c.id)).scalar_one())


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
    migrate.upgrade(db.engine, "0001")
    job_id = add_job_at_an_older_revision(db)
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


def test_0004_counts_what_existing_jobs_hold_and_downgrades(empty_database: str) -> None:
    db = Database.connect(empty_database)
    migrate.upgrade(db.engine, "0002")
    trained = add_job_at_an_older_revision(db, last_step=41, overflow_count=3, backoff_count=2)
    fresh = add_job_at_an_older_revision(db)

    def counted() -> list[tuple[int, ...]]:
        with db.engine.connect() as conn:
            query = text(
                "SELECT id, steps_recorded, overflows_recorded, backoffs_recorded "
                "FROM job ORDER BY id"
            )
            return [tuple(int(v) for v in row) for row in conn.execute(query)]

    migrate.upgrade(db.engine)
    assert counted() == [(trained, 42, 3, 2), (fresh, 0, 0, 0)]
    migrate.downgrade(db.engine, "0002")
    columns = {c["name"] for c in inspect(db.engine).get_columns("job")}
    assert not columns & {"steps_recorded", "overflows_recorded", "backoffs_recorded"}
    db.dispose()


def test_0007_rebuilds_the_rollup_levels_as_a_fresh_write_would_and_downgrades(
    empty_database: str, tmp_path: Path
) -> None:
    """A database whose rollups hold the old levels (64, 4096 and 262144 steps) gets exactly
    the rollups the head's write path makes, and buckets served from them equal the rows."""
    db = Database.connect(empty_database)
    migrate.upgrade(db.engine)  # 0007 rewrites no column: the head's models fit 0006 too
    job_id = add_job_at_an_older_revision(db, steps_recorded=0)
    # Across a 262144 edge, and with the job's first steps, so that every level has a block
    # made of many blocks below, and partial ones at both ends.
    records = synthetic_history(6000, seed=7) + synthetic_history(
        40_000, seed=8, start=262144 - 20_000
    )
    for i in range(0, len(records), 5000):
        with db.write() as s:
            job = s.get(Job, job_id)
            assert job is not None
            history.write_steps(s, job, records[i : i + 5000], now=utcnow())

    def stored() -> list[tuple[Any, ...]]:
        with db.engine.connect() as conn:
            query = text(
                "SELECT level, block, first_step, last_step, count, loss_min, loss_max, "
                "loss_last, scale_min, scale_max, scale_last, overflow_count, "
                "nonfinite_loss_count FROM step_rollup ORDER BY level, block"
            )
            return [tuple(r) for r in conn.execute(query)]

    written = stored()
    assert {r[0] for r in written} == {0, 1, 2, 3}
    migrate.downgrade(db.engine, "0006")  # the old layout, as that code kept it
    old = stored()
    assert {(r[0], r[1]) for r in old if r[0] > 0} == {
        (level, step // size)
        for level, size in ((1, 4096), (2, 262144))
        for step in (r.step for r in records)
    }
    assert [r for r in old if r[0] == 0] == [r for r in written if r[0] == 0]
    migrate.upgrade(db.engine)
    assert stored() == written
    settings = Settings(home=tmp_path, database_url=empty_database)
    with TestClient(create_app(settings, db, auth=False)) as client:
        api = Api(client, None)
        page = check_buckets(api, job_id, records, 280)
        assert page["width"] == rollups.LEVEL_BLOCKS[1]  # where the old layout had no level
        check_buckets(api, job_id, records, 3, 100, 262144 + 10_000)
    db.dispose()
