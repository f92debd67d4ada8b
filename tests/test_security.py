"""Security properties that tests can pin: tokens are kept only as hashes and looked up by
hash, no token or other secret reaches a log line or an error message, and CORS is
closed. (That ``halfway serve`` prints the first admin token once and only once is pinned in
tests/test_server_process.py; who may call what, in tests/test_team.py.)"""

from __future__ import annotations

import hashlib
import logging
import secrets
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select

from service.api.app import create_app
from service.database.db import Database
from service.database.models import User
from service.people import auth
from service.settings import Settings
from tests.conftest import Api, Team


def test_only_token_hashes_are_stored(db: Database, team: Team) -> None:
    tokens = {"alice": team.alice, "bob": team.bob, "root": team.admin}
    with db.read() as s:
        users = {u.name: u for u in s.scalars(select(User))}
        rows = [tuple(r) for r in s.execute(select(User.__table__)).all()]
    assert set(users) == set(tokens)
    for name, token in tokens.items():
        assert users[name].token_hash == hashlib.sha256(token.encode()).hexdigest()
    stored = repr(rows)
    for token in tokens.values():
        assert token not in stored
        assert token.removeprefix(auth.TOKEN_PREFIX) not in stored


def test_the_database_sees_only_the_token_digest_and_near_misses_fail(
    api: Api, db: Database, team: Team
) -> None:
    """The lookup by digest is the timing defence: the database compares SHA-256 digests, so
    the token itself never reaches a comparison an attacker could time byte by byte (nor the
    database's logs). Tokens one character off, cut short, extended, or the digest itself
    sent as a token are all refused."""
    sent: list[str] = []

    def capture(_c: Any, _cur: Any, statement: str, parameters: Any, *_: Any) -> None:
        sent.append(f"{statement} {parameters!r}")

    event.listen(db.engine, "before_cursor_execute", capture)
    try:
        assert api.get("/v1/jobs").status_code == 200
    finally:
        event.remove(db.engine, "before_cursor_execute", capture)
    digest = hashlib.sha256(team.alice.encode()).hexdigest()
    everything = "\n".join(sent)
    assert digest in everything  # looked up by its digest ...
    secret = team.alice.removeprefix(auth.TOKEN_PREFIX)
    assert secret not in everything and secret[:16] not in everything  # ... never by itself
    last = team.alice[-1]
    near_misses = [
        team.alice[:-1] + ("A" if last != "A" else "B"),
        team.alice[:-1],
        team.alice + "x",
        team.alice.upper(),
        digest,
        auth.TOKEN_PREFIX,
    ]
    for token in near_misses:
        r = api.client.get("/v1/jobs", headers=Team.header(token))
        assert r.status_code == 401, token


def _secret() -> str:
    return auth.TOKEN_PREFIX + secrets.token_urlsafe(32)


def test_no_token_reaches_a_log_or_a_response(
    api: Api, team: Team, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG)
    bogus, basic = _secret(), _secret()
    client = api.client
    seen: list[str] = []
    exchanges: list[tuple[dict[str, str], int]] = [
        ({}, 401),
        ({"Authorization": f"Bearer {bogus}"}, 401),
        ({"Authorization": f"Basic {basic}"}, 401),
        ({"Authorization": bogus}, 401),
        ({"Authorization": f"Bearer {team.alice}"}, 422),  # a valid token, a bad request
    ]
    for headers, status in exchanges:
        for method, path, kwargs in [
            ("GET", "/v1/jobs?limit=0", {}),
            ("POST", "/v1/jobs", {"json": {"training": {"epochs": 0}}}),
            ("GET", "/v1/jobs/0", {}),
        ]:
            r = client.request(method, path, headers=headers, **kwargs)
            assert r.status_code == status, (headers, path, r.text)
            seen.append(r.text)
            seen.extend(f"{k}: {v}" for k, v in r.headers.items())
    # The valid token, used successfully, is not logged either.
    assert client.get("/v1/jobs", headers=Team.header(team.alice)).status_code == 200
    out, err = capfd.readouterr()
    seen += [caplog.text, out, err]
    seen += [str(record.__dict__) for record in caplog.records]
    everything = "\n".join(seen)
    for secret in (bogus, basic, team.alice):
        assert secret not in everything
        assert secret.removeprefix(auth.TOKEN_PREFIX) not in everything


def test_validation_errors_never_echo_the_values_sent(api: Api) -> None:
    """A secret pasted into the wrong field (a token as the policy, say) is not sent back."""
    canary = _secret()
    spec = {
        "name": {"token": canary},
        "precision": {"policy": canary},
        "optimizer": {"name": canary},
        "training": {"epochs": canary, "jit_compile": canary},
        "resources": {"gpus": canary},
        "loss_scale": {"mode": canary},
        "data": {"kind": canary},
    }
    r = api.post("/v1/jobs", json=spec, headers={"Idempotency-Key": canary})
    assert r.status_code == 422
    assert len(r.json()["fields"]) >= 6
    assert canary not in r.text
    sweep = {"policies": [canary], "variants": [{"precision": {"policy": canary}}]}
    r = api.post("/v1/sweeps", json=sweep)
    assert r.status_code == 422
    assert canary not in r.text
    r = api.patch("/v1/jobs/1", json={"priority": canary})
    assert r.status_code == 422
    assert canary not in r.text


# The polls the lean path takes (service/api/leanpolls.py) among them: it must leave an outage to
# the routes, which report it.
@pytest.mark.parametrize(
    "path", ["/v1/jobs", "/v1/jobs?limit=100", "/v1/jobs/1", "/v1/jobs/1/history"]
)
def test_database_password_stays_out_of_errors_and_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str], path: str
) -> None:
    """The database is down: clients get a 503 that says so, and neither they nor the log see
    the connection string's password."""
    caplog.set_level(logging.DEBUG)
    password = secrets.token_urlsafe(16)
    url = f"postgresql://halfway:{password}@127.0.0.1:1/halfway"  # nothing listens on port 1
    settings = Settings(home=tmp_path, database_url=url)
    db = Database.connect(url)
    try:
        with TestClient(create_app(settings, db)) as client:
            r = client.get(path, headers=Team.header(_secret()))
    finally:
        db.dispose()
    assert r.status_code == 503, r.text
    assert r.json()["error"] == "database_unavailable"
    out, err = capfd.readouterr()
    assert "database unavailable" in caplog.text
    for text in (r.text, caplog.text, out, err):
        assert password not in text


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/jobs/1", "/healthz", "/", "/openapi.json"])
def test_cors_is_closed(api: Api, path: str) -> None:
    origin = {"Origin": "https://elsewhere.example"}
    preflight = api.client.options(
        path,
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 405
    plain = api.get(path, headers=origin)
    for r in (preflight, plain):
        assert not any(h.startswith("access-control-") for h in r.headers), dict(r.headers)
