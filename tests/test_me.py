"""``GET /v1/me``: who the caller's token belongs to (what the dashboard asks before it offers
cancel and priority), 401 without a token when auth is on, the local admin when it is off.
SQLite and PostgreSQL."""

from __future__ import annotations

from fastapi.testclient import TestClient

from service.api.app import create_app
from service.database.db import Database
from service.settings import Settings
from tests.conftest import Api, Team


def test_me_names_the_tokens_user_and_role(api: Api, team: Team) -> None:
    assert api.get("/v1/me").json() == {"name": "alice", "role": "member"}
    assert api.as_user(team.bob).get("/v1/me").json() == {"name": "bob", "role": "member"}
    assert api.as_user(team.admin).get("/v1/me").json() == {"name": "root", "role": "admin"}


def test_me_without_a_valid_token_is_a_401(api: Api) -> None:
    for token in (None, "hw_not-a-token"):
        r = api.as_user(token).get("/v1/me")
        assert r.status_code == 401
        assert r.json()["error"] == "unauthorized"


def test_with_auth_off_the_caller_is_the_local_admin(settings: Settings, db: Database) -> None:
    with TestClient(create_app(settings, db, auth=False)) as client:
        assert client.get("/v1/me").json() == {"name": "local", "role": "admin"}
