"""The HTTP contract where JSON and HTTP are precise: a JSON body's types are JSON's own (no
``false`` read as 0, no ``"5"`` read as 5), and a 405 names every method its path answers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from service.api.deps import decimal_range_pattern
from service.client.specfile import load_spec
from service.database.db import Database
from service.database.models import Job
from tests.conftest import Api

# (path in the spec, a value of the wrong JSON type that pydantic's lax mode accepted)
WRONG_TYPES: list[tuple[str, Any]] = [
    ("priority", False),
    ("priority", True),
    ("priority", "5"),
    ("max_attempts", 2.5),
    ("training.epochs", True),
    ("training.epochs", "3"),
    ("training.seed", False),
    ("training.validation_split", False),
    ("training.jit_compile", 1),
    ("training.jit_compile", "true"),
    ("optimizer.learning_rate", True),
    ("optimizer.learning_rate", "0.01"),
    ("precision.output_float32", 1),
    ("precision.output_float32", "yes"),
    ("precision.graph_rewrite", 0),
    ("resources.gpus", False),
    ("resources.gpus", "1"),
    ("loss_scale.hysteresis", True),
    ("loss_scale.dynamic", "false"),
    ("data.samples", True),
    ("model.hidden", [True]),
    ("faults.nonfinite_at_steps", ["3"]),
    ("outputs.tensorboard", 1),
]


def _nested(path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    return {head: _nested(rest, value) if rest else value}


@pytest.mark.parametrize(("field", "value"), WRONG_TYPES)
def test_a_json_value_of_the_wrong_type_is_a_422_naming_the_field(
    api: Api, db: Database, field: str, value: Any
) -> None:
    r = api.post("/v1/jobs", json=_nested(field, value))
    assert r.status_code == 422, r.text
    named = {f["field"] for f in r.json()["fields"]}
    assert named in ({field}, {f"{field}.0"}), r.text  # a list's item is named by its index
    with db.read() as s:
        assert s.scalars(select(Job)).first() is None


@pytest.mark.parametrize("value", [False, True, "7", 7.5, None])
def test_patch_priority_takes_only_a_json_integer(api: Api, db: Database, value: Any) -> None:
    job = api.post("/v1/jobs", json={"priority": 50}).json()["id"]
    r = api.patch(f"/v1/jobs/{job}", json={"priority": value})
    assert r.status_code == 422, r.text
    assert r.json()["fields"][0]["field"] == "priority"
    assert api.get(f"/v1/jobs/{job}").json()["priority"] == 50
    ok = api.patch(f"/v1/jobs/{job}", json={"priority": 7})
    assert ok.status_code == 200 and ok.json()["priority"] == 7


def test_sweep_fields_refuse_wrong_json_types(api: Api) -> None:
    for body in (
        {"policies": ["float32"], "target_loss": True},
        {"policies": ["float32"], "name": 5},
        {"variants": [{"name": False}]},
    ):
        r = api.post("/v1/sweeps", json=body)
        assert r.status_code == 422, (body, r.text)


def test_json_numbers_and_booleans_still_pass(api: Api) -> None:
    spec = {
        "priority": 0,
        "training": {"epochs": 1, "validation_split": 0, "jit_compile": False},
        "optimizer": {"learning_rate": 1},  # an integer where a float is asked is a number
        "precision": {"output_float32": False},
        "resources": {"gpus": 0},
    }
    r = api.post("/v1/jobs?dry_run=true", json=spec)
    assert r.status_code == 200, r.text
    assert r.json()["spec"]["optimizer"]["learning_rate"] == 1.0
    # JSON Schema's integer: 29.0 is one (JSON has a single number type).
    r = api.post("/v1/jobs?dry_run=true", json={"priority": 29.0, "model": {"hidden": [8.0]}})
    assert r.status_code == 200, r.text
    assert r.json()["spec"]["priority"] == 29 and r.json()["spec"]["model"]["hidden"] == [8]


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/v1/jobs/1", {"GET", "PATCH"}),
        ("PUT", "/v1/jobs/1", {"GET", "PATCH"}),
        ("OPTIONS", "/v1/jobs/1", {"GET", "PATCH"}),
        ("DELETE", "/v1/jobs", {"GET", "POST"}),
        ("PATCH", "/v1/datasets", {"GET", "POST"}),
        ("GET", "/v1/jobs/1/cancel", {"POST"}),
        ("POST", "/v1/jobs/1/history", {"GET"}),
        ("DELETE", "/v1/sweeps", {"POST"}),
        ("POST", "/v1/history", {"GET"}),
    ],
)
def test_a_405_lists_every_method_the_path_allows(
    api: Api, method: str, path: str, allowed: set[str]
) -> None:
    r = api.request(method, path)
    assert r.status_code == 405, r.text
    assert {m.strip() for m in r.headers["allow"].split(",")} == allowed
    assert r.json()["error"] == "http_error"
    # Every method Allow names is really answered (not with another 405).
    for other in allowed:
        assert api.request(other, path).status_code != 405, other


def test_a_yaml_spec_reads_exponent_numbers_as_numbers(tmp_path: Path) -> None:
    """PyYAML (YAML 1.1) reads 1e-3 as a string, which the strict API refuses; the client reads
    it as the float it means, and leaves strings that only look alike alone."""
    path = tmp_path / "job.yaml"
    path.write_text(
        "optimizer:\n  learning_rate: 1e-3\ntraining:\n  target_loss: 2.5E+1\nname: 1e3x\n"
    )
    spec = load_spec(str(path))
    assert spec["optimizer"]["learning_rate"] == 0.001
    assert spec["training"]["target_loss"] == 25.0
    assert spec["name"] == "1e3x"


@pytest.mark.parametrize("hi", [1, 9, 10, 57, 100, 999, 1000, 4096, 2**31 - 1])
def test_the_id_pattern_matches_exactly_one_to_hi(hi: int) -> None:
    pattern = re.compile(decimal_range_pattern(hi))
    near = {0, 1, 2, hi - 1, hi, hi + 1, hi * 10, *range(0, min(hi + 2, 3000))}
    for n in sorted(near):
        assert bool(pattern.fullmatch(str(n))) == (1 <= n <= hi), n
    for text in ("01", "-1", "", "1.0", " 1", "+1"):
        assert not pattern.fullmatch(text), text


@pytest.mark.parametrize(
    ("job_ids", "status"),
    [("1", 404), ("2147483647", 404), ("1,2", 404), ("0", 422), ("2147483648", 422), ("01", 422)],
)
def test_compare_history_job_ids_follow_the_documented_pattern(
    api: Api, job_ids: str, status: int
) -> None:
    r = api.get(f"/v1/history?job_ids={job_ids}")
    assert r.status_code == status, r.text
    if status == 422:
        assert r.json()["fields"][0]["field"] in ("job_ids", "query.job_ids")


def test_every_reference_in_the_openapi_document_resolves(api: Api) -> None:
    """A dangling $ref makes a generator send no body at all (the sweep's base once pointed
    at JobSpec after pydantic had split it into JobSpec-Input and JobSpec-Output)."""
    document = api.client.get("/openapi.json").json()
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    assert refs
    schemas = document["components"]["schemas"]
    missing = sorted({r for r in refs if r.removeprefix("#/components/schemas/") not in schemas})
    assert missing == []
