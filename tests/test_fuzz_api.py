"""API fuzzing: schemathesis generates requests from Halfway's own OpenAPI document (schema-valid
ones and schema-breaking ones) for every operation, sends them with a valid token through the
real app, on SQLite and PostgreSQL, and checks each answer:

- never a 5xx;
- the status code is documented for the operation, the content type and body match the
  schema (so every error body is ErrorOut: error, message, fields);
- a request that breaks the schema is refused (4xx);
- a schema-valid request is accepted, except where a rule spans fields (see ``CROSS_FIELD``);
- every 422, and every refusal of a job or sweep spec (bar a 401), names in ``fields`` a field
  or parameter the operation has.

Bounded so CI stays fast and reproducible: ``EXAMPLES`` per operation and mode, derandomized,
no example database. The event stream (``/events``) ends only when its job does, so its
schema-valid requests are aimed at a job that has already finished; its schema-breaking ones
are refused before any streaming starts (and ``STREAM_TIMEOUT`` cuts a stream short anyway).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode

from service.api.routes import history as history_routes
from service.database.db import Database
from service.database.models import Job, utcnow
from service.people.authcache import FailureLimiter
from service.recording import history
from service.recording.records import StepRecord
from service.settings import Settings
from service.specs.schemas import LEGACY_AMP_ENV
from tests.apiprocess import ApiProcess
from tests.conftest import Api, Team

EXAMPLES = 40
# The ignored_auth check sends bad tokens to every operation and wants a 401 each time, not the
# 429 that the failed-authentication limit answers past its burst (tests/test_tokens.py).
UNLIMITED = 10**9
# Per operation and phase in the schemathesis CLI run (the coverage phase adds its own boundary
# cases on top); with these the run takes about half a minute on an idle 2-core machine.
ST_EXAMPLES = 10
STREAM_TIMEOUT = 10.0
# The schemathesis CLI's phases on PostgreSQL (False) and SQLite (True): see the test.
PHASES = {False: "examples,fuzzing,stateful", True: "examples,coverage,fuzzing,stateful"}

# Every operation in the schema; test_every_operation_is_fuzzed keeps this list complete.
OPERATIONS = [
    "POST /v1/jobs",
    "GET /v1/jobs",
    "GET /v1/jobs/{job_id}",
    "PATCH /v1/jobs/{job_id}",
    "POST /v1/jobs/{job_id}/cancel",
    "GET /v1/jobs/{job_id}/history",
    "GET /v1/jobs/{job_id}/loss-scale/events",
    "GET /v1/jobs/{job_id}/history.csv",
    "GET /v1/jobs/{job_id}/history.arrow",
    "GET /v1/jobs/{job_id}/history.parquet",
    "GET /v1/jobs/{job_id}/gradients",
    "GET /v1/jobs/{job_id}/metrics",
    "GET /v1/jobs/{job_id}/events",
    "GET /v1/history",
    "GET /v1/policies",
    "GET /healthz",
    "GET /v1/vocabulary",
    "GET /v1/jobs/{job_id}/artifacts",
    "GET /v1/jobs/{job_id}/artifacts/{name}",
    "GET /v1/jobs/{job_id}/logs",
    "GET /v1/datasets",
    "POST /v1/datasets",
    "GET /v1/datasets/{path}",
    "POST /v1/sweeps",
    "GET /v1/sweeps/{sweep_id}",
    "POST /v1/code",
    "GET /v1/code/{digest}",
    "GET /v1/queue",
    "GET /v1/users/shares",
    "GET /v1/me",
    "PUT /v1/users/{name}/share",
]

# Schema-valid input that a rule spanning several fields still refuses, rightly, with a 422:
# a loss scale outside [min_scale, max_scale], a model that does not fit its data, momentum on
# adam, a sweep without variants, to_step below from_step, more than 10,000 rows a page
# without format=columns (or 1,000 gradient samples with format=json), bytes that are not an
# .npz.
# JSON Schema cannot say these, so "valid data is accepted" is not checked here; the 422 must
# still name the field (checked for every operation).
CROSS_FIELD = {
    "POST /v1/code",
    "POST /v1/jobs",
    "POST /v1/sweeps",
    "POST /v1/datasets",
    "GET /v1/history",
    "GET /v1/jobs/{job_id}/history",
    "GET /v1/jobs/{job_id}/history.arrow",
    "GET /v1/jobs/{job_id}/history.parquet",
    "GET /v1/jobs/{job_id}/gradients",
}
STREAMING = "GET /v1/jobs/{job_id}/events"
SPECS = {"POST /v1/jobs", "POST /v1/sweeps"}

CONFIG = SchemathesisConfig.from_dict(
    {
        "generation": {
            # Every request carries alice's valid token; the auth matrix (tests/test_team.py)
            # covers missing and bad tokens on every endpoint.
            "with-security-parameters": False,
            # Like most HTTP APIs (and FastAPI's default), Halfway ignores query parameters it
            # does not know; only bodies refuse unknown fields.
            "allow-extra-parameters": False,
        }
    }
)

SETTINGS = hypothesis.settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)


@dataclass
class Seeded:
    schema: Any
    openapi: dict[str, Any]
    finished_job: int
    job_ids: list[int]
    sweep_id: int


@pytest.fixture
def seeded(
    client: TestClient,
    team: Team,
    db: Database,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> Seeded:
    """Something for every path to find: alice's finished job with history, scale events, a
    model and a log; her queued job; bob's queued job; a sweep."""
    monkeypatch.setattr(history_routes, "SSE_POLL_SECONDS", 0.01)
    client.app.state.auth_cache.limiter = FailureLimiter(UNLIMITED, 1.0)  # type: ignore[attr-defined]
    alice, bob = Api(client, team.alice), Api(client, team.bob)
    finished = alice.post("/v1/jobs", json={"name": "done"}).json()["id"]
    waiting = alice.post("/v1/jobs", json={"name": "waiting"}).json()["id"]
    bobs = bob.post("/v1/jobs", json={"name": "bobs"}).json()["id"]
    r = alice.post("/v1/sweeps", json={"policies": ["float32", "mixed_float16"]})
    assert r.status_code == 201, r.text
    sweep = r.json()
    # Overflows at steps 7 and 8 (the scale halves after each), a NaN loss at 7.
    records = [
        StepRecord(
            s,
            s // 10,
            math.nan if s == 7 else 2.0 / (s + 1),
            1024.0 if s <= 7 else 512.0 if s == 8 else 256.0,
            s not in (7, 8),
        )
        for s in range(30)
    ]
    with db.write() as s:
        job = s.get(Job, finished)
        assert job is not None
        history.write_steps(s, job, records, now=utcnow())
        job.status, job.started_at, job.finished_at = "succeeded", utcnow(), utcnow()
    folder = settings.resolved_artifact_dir() / str(finished)
    folder.mkdir(parents=True)
    (folder / "model.keras").write_bytes(b"PK\x03\x04 model")
    (folder / "train.log").write_text("epoch 1\nepoch 2\n")
    openapi: dict[str, Any] = client.app.openapi()  # type: ignore[attr-defined]
    schema = schemathesis.openapi.from_dict(openapi, config=CONFIG)
    schema.app = client.app
    return Seeded(
        schema=schema,
        openapi=openapi,
        finished_job=finished,
        job_ids=[finished, waiting, bobs, *(v["job_id"] for v in sweep["variants"])],
        sweep_id=sweep["id"],
    )


def test_every_operation_is_fuzzed(seeded: Seeded) -> None:
    labels = [op.ok().label for op in seeded.schema.get_all_operations()]
    assert sorted(labels) == sorted(OPERATIONS)


def _names(openapi: dict[str, Any], path: str, method: str) -> set[str]:
    """What a 422 may name: the body, its top-level properties, and the parameters (bare, as
    Halfway's own checks name them, or prefixed with their location, as FastAPI's do)."""
    operation = openapi["paths"][path][method.lower()]
    names = {"body", LEGACY_AMP_ENV}
    for param in operation.get("parameters", []):
        names |= {param["name"], f"{param['in']}.{param['name']}"}
    for media in operation.get("requestBody", {}).get("content", {}).values():
        ref = media["schema"]["$ref"].rsplit("/", 1)[-1]
        names |= set(openapi["components"]["schemas"][ref]["properties"])
    return names


def _check_error_body(label: str, case: Any, response: Any, names: set[str]) -> None:
    """A refusal says which field broke which rule; the field is one the operation has (or an
    unknown one the client sent, which is what extra_forbidden reports)."""
    body = response.json()
    assert set(body) == {"error", "message", "fields"}, body
    status = response.status_code
    if status == 422:
        assert body["error"] == "validation_error"
    elif label not in SPECS or status in (401, 403):
        # Who may do it, not what was wrong with it: a bad token, or a code job from a member
        # without the right (the message names the setting and the grant).
        return
    assert body["fields"], body
    known = {n.lower() for n in names}
    if isinstance(case.body, dict):
        known |= {str(k).lower() for k in case.body}
    for field in body["fields"]:
        assert field["field"] and field["rule"] and field["message"], field
        parts = field["field"].lower().split(".")
        assert {parts[0], ".".join(parts[:2])} & known, f"{field} names nothing in {known}"


def _strategies(seeded: Seeded, label: str) -> list[Any]:
    """Schema-valid requests (anywhere, and aimed at the seeded jobs and sweep, since random
    ids mostly miss), then schema-breaking ones where the operation has any input."""
    method, path = label.split(" ", 1)
    operation = seeded.schema[path][method]
    positive, negative = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
    if label == STREAMING:
        # The stream ends with its job: aim valid requests at the finished one.
        fixed = {"job_id": seeded.finished_job}
        return [
            operation.as_strategy(positive, path_parameters=fixed),
            operation.as_strategy(negative),
        ]
    out = [operation.as_strategy(positive)]
    for name, ids in (("job_id", seeded.job_ids), ("sweep_id", [seeded.sweep_id])):
        if "{" + name + "}" in path:
            out.append(
                st.sampled_from(ids).flatmap(
                    lambda i, name=name: operation.as_strategy(  # type: ignore[misc]
                        positive, path_parameters={name: i}
                    )
                )
            )
    if any(
        list(getattr(operation, location))
        for location in ("path_parameters", "query", "headers", "body")
    ):
        out.append(operation.as_strategy(negative))
    return out


def _fuzz(seeded: Seeded, label: str, token: str) -> None:
    method, path = label.split(" ", 1)
    names = _names(seeded.openapi, path, method)
    excluded: list[Callable[..., Any]] = []
    if label in CROSS_FIELD:
        excluded.append(schemathesis.checks.positive_data_acceptance)
    for strategy in _strategies(seeded, label):

        @given(case=strategy)
        @SETTINGS
        def run(case: Any) -> None:
            response = case.call(headers=Team.header(token), timeout=STREAM_TIMEOUT)
            case.validate_response(response, excluded_checks=excluded)
            if response.status_code >= 400:
                _check_error_body(label, case, response, names)

        run()


@pytest.mark.parametrize("label", OPERATIONS)
def test_fuzzed_requests_get_documented_answers_never_a_5xx(
    seeded: Seeded, team: Team, label: str
) -> None:
    _fuzz(seeded, label, team.alice)


# Operations whose schema-valid requests a rule spanning fields may rightly refuse (see
# CROSS_FIELD above): for these, and only these, "valid data is accepted" is not checked.
ST_CONFIG = """
[generation]
allow-extra-parameters = false

[phases.stateful.inference]
# The document's own links (service/api/openapi.py) say which response feeds which request;
# guessing from field names linked a job's null sweep_id to GET /v1/sweeps/None.
algorithms = []

[[operations]]
include-name = {cross_field}
checks.positive_data_acceptance.enabled = false

[[operations]]
include-name = "GET /v1/jobs/{{job_id}}/events"
# A stream ends with its job: aim it at the finished one.
parameters = {{ job_id = {finished} }}
max-stream-events = 5

[[operations]]
include-name = "GET /v1/jobs/{{job_id}}/artifacts/{{name}}"
parameters = {{ job_id = {finished}, name = "model.keras" }}
"""


def test_schemathesis_with_every_check_and_every_phase_finds_nothing(
    db_url: str, db: Database, team: Team, tmp_path: Path
) -> None:
    """The schemathesis CLI, every check and every phase (examples, coverage, fuzzing and the
    stateful phase that follows the document's links), against a real `halfway serve`.

    The coverage phase runs on SQLite only. Its cases are the boundaries of every field of the
    document (about 4,300 requests, nearly all to POST /v1/jobs and /v1/sweeps, ~4 minutes on
    a 2-core machine), and what they test, validation, runs before any database is touched;
    what reaches the database is covered on both by the fuzzing and stateful phases here and
    by the property tests above."""
    home = tmp_path / "api"
    api = ApiProcess(db_url, home, env={"HALFWAY_AUTH_FAILURE_BURST": str(UNLIMITED)})
    try:
        api.wait_ready()
        headers = Team.header(team.alice)
        finished = httpx.post(
            f"{api.url}/v1/jobs", json={"name": "done"}, headers=headers, timeout=10
        ).json()["id"]
        with db.write() as s:
            job = s.get(Job, finished)
            assert job is not None
            records = [StepRecord(i, 0, 1.0 / (i + 1), 1024.0, i != 5) for i in range(20)]
            history.write_steps(s, job, records, now=utcnow())
            job.status, job.started_at, job.finished_at = "succeeded", utcnow(), utcnow()
        folder = home / "artifacts" / str(finished)
        folder.mkdir(parents=True)
        (folder / "model.keras").write_bytes(b"PK\x03\x04 model")
        config = tmp_path / "schemathesis.toml"
        cross_field = "[" + ", ".join(f'"{label}"' for label in sorted(CROSS_FIELD)) + "]"
        config.write_text(ST_CONFIG.format(cross_field=cross_field, finished=finished))
        command = [
            str(Path(sys.executable).parent / "schemathesis"),
            "--config-file",
            str(config),
            "run",
            f"{api.url}/openapi.json",
            "--header",
            f"Authorization: Bearer {team.alice}",
            "--phases",
            PHASES[db.dialect == "sqlite"],
            "--max-examples",
            str(ST_EXAMPLES),
            "--seed",
            "1",
            "--workers",
            "1",
            "--request-timeout",
            str(STREAM_TIMEOUT),
        ]
        # In tmp_path: schemathesis keeps a cache in its working directory.
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    finally:
        api.stop()
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
    assert "19 selected / 19 total" in done.stdout
    # The coverage phase ran (a check mark, not the skip sign) on SQLite alone.
    assert bool(re.search(r"✅\s+Coverage", done.stdout)) == (db.dialect == "sqlite")
    # The stateful phase ran scenarios along the document's links.
    assert re.search(r"Scenarios:\s+[1-9]", done.stdout), done.stdout[-3000:]


@pytest.mark.parametrize(
    ("label", "at_least"),
    [("GET /v1/history", 0.9), ("POST /v1/sweeps", 0.4), ("POST /v1/jobs", 0.4)],
)
def test_most_schema_valid_requests_are_accepted(
    seeded: Seeded, team: Team, label: str, at_least: float
) -> None:
    """The document is as strict as the validation where JSON Schema can say the rule, so
    what the rules spanning fields refuse (CROSS_FIELD) is the exception. Before, a sweep's
    base and variants were "any object" and 12% of generated sweeps were accepted; job ids in
    job_ids could be 0 or 9999999999 (81% of comparisons)."""
    method, path = label.split(" ", 1)
    operation = seeded.schema[path][method]
    outcomes: list[bool] = []

    @given(case=operation.as_strategy(GenerationMode.POSITIVE))
    @hypothesis.settings(SETTINGS, max_examples=100)
    def run(case: Any) -> None:
        response = case.call(headers=Team.header(team.alice))
        assert response.status_code < 500
        accepted = response.status_code < 300 or response.status_code == 404
        outcomes.append(accepted)
        if not accepted:  # why, for the message below: the status and the rule refused
            try:
                body = response.json()
            except ValueError:  # not JSON: the status alone says it
                body = {}
            fields = (body.get("fields") if isinstance(body, dict) else None) or [{}]
            refused[f"{response.status_code} {fields[0].get('rule', '')}"] += 1

    refused: Counter[str] = Counter()
    run()
    assert sum(outcomes) / len(outcomes) >= at_least, (
        f"{sum(outcomes)} of {len(outcomes)} accepted; refused: {refused.most_common()}"
    )


def test_fuzzed_code_uploads_by_an_admin_get_documented_answers(seeded: Seeded, team: Team) -> None:
    # Alice may not upload code (403); an admin's uploads reach the archive checks.
    _fuzz(seeded, "POST /v1/code", team.admin)
