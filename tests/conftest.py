"""Shared fixtures. Every database test runs on SQLite, and on PostgreSQL too when
HALFWAY_TEST_DATABASE_URL is set (``.ci/run`` sets it; if that server is down the tests fail,
they are never skipped)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from service.api.app import create_app
from service.database import migrate
from service.database.db import Database, normalize_url
from service.database.models import Base
from service.people import auth
from service.settings import Settings
from tests.turns import turn

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytest_plugins = ["tests.live", "tests.s3"]

PG_URL = os.environ.get("HALFWAY_TEST_DATABASE_URL")
BACKENDS = ["sqlite", "postgresql"] if PG_URL else ["sqlite"]
# Every table a test may write, emptied before each PostgreSQL test (one database per worker):
# all of the models' but auth_state, whose one row the migrations insert. Listed from the
# models, so that a new table cannot carry rows from one test into the next.
TABLES = tuple(f'"{name}"' for name in sorted(Base.metadata.tables) if name != "auth_state")


@pytest.fixture(scope="session")
def turns_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path | None:
    """Where this run's workers keep their locks (the parent of their temporary folders),
    or None in a run of one process."""
    if not hasattr(request.config, "workerinput"):  # set by xdist in its workers only
        return None
    return tmp_path_factory.getbasetemp().parent


@pytest.fixture(autouse=True)
def postgresql_turn(request: pytest.FixtureRequest, turns_dir: Path | None) -> Iterator[None]:
    """Every test's turn on the PostgreSQL server (``tests/turns.py``), SQLite ones too: a
    restart would cut a live server's or a worker's connections whatever the test is on."""
    exclusive = request.node.get_closest_marker("restarts_postgresql") is not None
    with turn(turns_dir, exclusive=exclusive):
        yield


@pytest.fixture(scope="session")
def pg_database(turns_dir: Path | None) -> Iterator[str]:
    """A database of our own on the PostgreSQL server, migrated once, dropped at the end
    (each xdist worker has its own)."""
    assert PG_URL, "HALFWAY_TEST_DATABASE_URL is not set"
    admin_url = make_url(normalize_url(PG_URL))
    name = f"halfway_test_{uuid.uuid4().hex[:8]}"
    # No pool: a test restarts the server, and a pooled connection would be dead at teardown.
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    url = admin_url.set(database=name).render_as_string(hide_password=False)
    with turn(turns_dir, exclusive=False):  # not while another worker restarts the server
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        db = Database.connect(url)
        migrate.upgrade(db.engine)
        db.dispose()
    try:
        yield url
    finally:
        with turn(turns_dir, exclusive=False), admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :n AND pid <> pg_backend_pid()"
                ),
                {"n": name},
            )
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        admin.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file, copied for each test (faster than migrating each time)."""
    path = tmp_path_factory.mktemp("template") / "template.db"
    db = Database.connect(f"sqlite:///{path}")
    migrate.upgrade(db.engine)
    with db.engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    db.dispose()
    return path


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path, sqlite_template: Path) -> str:
    if request.param == "sqlite":
        path = tmp_path / "halfway.db"
        shutil.copy(sqlite_template, path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("pg_database")
    engine = create_engine(normalize_url(url))
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    engine.dispose()
    return url


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database.connect(db_url)
    yield database
    database.dispose()


@pytest.fixture
def settings(tmp_path: Path, db_url: str) -> Settings:
    s = Settings(
        home=tmp_path / "home",
        database_url=db_url,
        lease_seconds=30,
        poll_seconds=0.05,
        history_flush_seconds=0.1,
        cancel_grace_seconds=5,
        # The poll cache stays on (0.5 s), as in production: a test that writes history or a
        # job behind the API's back and reads it at once must wait for the snapshot to age,
        # as a real client would.
    )
    s.ensure_dirs()
    return s


@dataclass
class Team:
    """Tokens for a small team: two members and an admin."""

    alice: str
    bob: str
    admin: str

    @staticmethod
    def header(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def team(db: Database) -> Team:
    with db.write() as session:
        return Team(
            alice=auth.add_user(session, "alice"),
            bob=auth.add_user(session, "bob"),
            admin=auth.add_user(session, "root", admin=True),
        )


class Api:
    """A TestClient that sends one user's token."""

    def __init__(self, client: TestClient, token: str | None) -> None:
        self.client = client
        self.headers = Team.header(token) if token else {}

    def request(self, method: str, url: str, **kwargs: Any) -> Any:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return self.client.request(method, url, headers=headers, **kwargs)

    def get(self, url: str, **kwargs: Any) -> Any:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> Any:
        return self.request("POST", url, **kwargs)

    def patch(self, url: str, **kwargs: Any) -> Any:
        return self.request("PATCH", url, **kwargs)

    def as_user(self, token: str | None) -> Api:
        return Api(self.client, token)


@pytest.fixture
def client(settings: Settings, db: Database) -> Iterator[TestClient]:
    with TestClient(create_app(settings, db, auth=True)) as c:
        yield c


@pytest.fixture
def api(client: TestClient, team: Team) -> Api:
    """Requests as alice."""
    return Api(client, team.alice)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's headless Chromium driven by Playwright (its own browser download is not
    reachable here), one per test module. Imported here, not at the top: most tests need no
    browser."""
    from playwright.sync_api import sync_playwright

    from tests.test_dashboard import CHROMIUM, CHROMIUM_ARGS

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()
