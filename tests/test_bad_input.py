"""The bad-input catalogue: every way a client can send garbage, and what it gets back. Each case
asserts the exact status, that the error names what was wrong, and that nothing was stored (no
job or sweep row, no file).

Covered elsewhere, and not repeated here:
- tests/test_spec_validation.py: unknown and wrong-typed spec fields, NaN/Infinity in a job
  spec, malformed JSON, a billion epochs, a batch of 10**9, a model of 10**12 parameters (the
  limit named), npz paths with ``..`` or absolute, missing, or not ``.npz``.
- tests/test_api_jobs.py: a body over the limit with Content-Length (POST /v1/jobs), bad
  history cursors, missing and bogus tokens, Idempotency-Key reuse, artifact names.
- tests/test_team.py: uploads that are no npz, have object arrays, bad shapes and dtypes, names
  that escape, the upload size limit; the auth matrix of every endpoint.
- tests/test_history_queries.py: a zoom with to_step below from_step, points out of range.
"""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.api.app import create_app
from service.database.db import Database
from service.database.models import Job, Sweep
from service.settings import Settings
from tests.conftest import Api, Team
from workers.data import load_arrays
from workers.protocol import JobError

JSON = {"Content-Type": "application/json"}
SMALL_BODY, SMALL_UPLOAD = 4096, 16384


# --------------------------------------------------------------------------------------------
# Helpers


def _stored(db: Database, settings: Settings) -> tuple[int, int, list[str]]:
    """Job rows, sweep rows, and every file under the data and artifact directories."""
    with db.read() as s:
        jobs = s.scalar(select(func.count()).select_from(Job)) or 0
        sweeps = s.scalar(select(func.count()).select_from(Sweep)) or 0
    files = sorted(
        str(p)
        for root in (settings.resolved_data_dir(), settings.resolved_artifact_dir())
        for p in root.rglob("*")
        if not p.is_dir()
    )
    return jobs, sweeps, files


@pytest.fixture
def unchanged(db: Database, settings: Settings) -> Iterator[None]:
    """Fails the test if it stored anything."""
    before = _stored(db, settings)
    yield
    assert _stored(db, settings) == before


def _fields(r: Any) -> list[tuple[str, str]]:
    body = r.json()
    assert set(body) == {"error", "message", "fields"}, body
    return [(f["field"], f["rule"]) for f in body["fields"]]


def _refused(r: Any, status: int, field: str, rule: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    pairs = _fields(r)
    assert field in [f for f, _ in pairs], pairs
    if rule is not None:
        assert (field, rule) in pairs, pairs
    body: dict[str, Any] = r.json()
    return body


def _submit(api: Api, **spec: Any) -> int:
    r = api.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


def _chunks(data: bytes, size: int = 1024) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _npz(**arrays: Any) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _good_npz() -> bytes:
    return _npz(x_train=np.zeros((3, 2), np.float32), y_train=np.zeros(3, np.int64))


def _upload(api: Api, name: str, content: bytes) -> Any:
    return api.post(
        "/v1/datasets",
        files={"file": ("data.npz", content, "application/octet-stream")},
        data={"name": name},
    )


class _Trap:
    """Unpickling this touches a file: if the marker exists, something unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (pathlib.Path.touch, (self.marker,))


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "unpickled"
    yield path
    assert not path.exists(), "a pickle was loaded"


def _patched_zip(flags: int = 0, method: int | None = None, magic: bytes | None = None) -> bytes:
    """A real .npz with its zip headers edited: the encryption flag, the compression method
    number, or the local header's signature."""
    data = bytearray(_good_npz())
    for signature, flag_at, method_at in ((b"PK\x03\x04", 6, 8), (b"PK\x01\x02", 8, 10)):
        i = data.find(signature)
        while i != -1:
            data[i + flag_at] |= flags
            if method is not None:
                data[i + method_at : i + method_at + 2] = method.to_bytes(2, "little")
            i = data.find(signature, i + 4)
    if magic is not None:
        i = data.find(b"PK\x03\x04")
        data[i : i + 4] = magic
    return bytes(data)


# --------------------------------------------------------------------------------------------
# Oversized bodies: 413 before anything parses them, with or without Content-Length


@pytest.fixture
def small(settings: Settings, db: Database, team: Team) -> Iterator[Api]:
    """An app with a 4 KB body limit and a 16 KB upload limit, so oversized bodies are cheap."""
    limited = settings.model_copy(
        update={"max_body_bytes": SMALL_BODY, "max_upload_bytes": SMALL_UPLOAD}
    )
    with TestClient(create_app(limited, db)) as c:
        yield Api(c, team.alice)


BODY_ROUTES = [("POST", "/v1/jobs"), ("POST", "/v1/sweeps"), ("PATCH", "/v1/jobs/{id}")]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize(("method", "path"), BODY_ROUTES, ids=[f"{m} {p}" for m, p in BODY_ROUTES])
def test_oversized_body_is_413_before_parsing_with_or_without_content_length(
    small: Api, db: Database, settings: Settings, method: str, path: str, chunked: bool
) -> None:
    job_id = _submit(small)
    before = _stored(db, settings)
    # Not even JSON: a parser would answer 422; the limit answers first.
    body = b"[" * (SMALL_BODY + 1)
    content: bytes | Iterator[bytes] = _chunks(body) if chunked else body
    r = small.request(method, path.format(id=job_id), content=content, headers=JSON)
    if chunked:
        assert "content-length" not in r.request.headers
        assert r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413, r.text
    message = f"request body exceeds {SMALL_BODY} bytes"
    assert r.json() == {
        "error": "payload_too_large",
        "message": message,
        "fields": [{"field": "body", "rule": "too_large", "message": message}],
    }
    assert _stored(db, settings) == before


def test_body_at_the_limit_is_parsed(small: Api) -> None:
    name = "x" * 150
    body = json.dumps({"name": name}).encode()
    body += b" " * (SMALL_BODY - len(body))
    r = small.post("/v1/jobs?dry_run=true", content=_chunks(body), headers=JSON)
    assert r.status_code == 200, r.text
    assert r.json()["spec"]["name"] == name


def _multipart(name: str, payload: bytes) -> tuple[bytes, dict[str, str]]:
    boundary = "halfway-test-boundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\n{name}\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
        'filename="big.npz"\r\nContent-Type: application/octet-stream\r\n\r\n'
    )
    body = head.encode() + payload + f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_upload_is_413_and_leaves_no_file(
    small: Api, settings: Settings, unchanged: None, chunked: bool
) -> None:
    payload = _npz(x_train=np.zeros((1000, 4), np.float32), y_train=np.zeros(1000, np.int64))
    assert len(payload) > SMALL_UPLOAD
    body, headers = _multipart("big", payload)
    r = small.post("/v1/datasets", content=_chunks(body) if chunked else body, headers=headers)
    assert r.status_code == 413, r.text
    assert r.json()["error"] == "payload_too_large"
    assert str(SMALL_UPLOAD) in r.json()["message"]
    assert not list(settings.resolved_data_dir().rglob("*.part"))


# --------------------------------------------------------------------------------------------
# Bodies that cannot be parsed: a 422 naming the body, never a 500


DEEP = {
    "100k nested arrays": b"[" * 100_000 + b"]" * 100_000,
    "100k nested objects": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "deep inside a field": b'{"name": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("body", DEEP.values(), ids=DEEP.keys())
@pytest.mark.parametrize(("method", "path"), BODY_ROUTES, ids=[f"{m} {p}" for m, p in BODY_ROUTES])
def test_deeply_nested_json_is_422_naming_the_body(
    api: Api, db: Database, settings: Settings, method: str, path: str, body: bytes
) -> None:
    job_id = _submit(api)
    before = _stored(db, settings)
    r = api.request(method, path.format(id=job_id), content=body, headers=JSON)
    found = _refused(r, 422, "body", "unparseable")
    assert "nested too deeply" in found["message"]
    assert _stored(db, settings) == before
    assert api.get(f"/v1/jobs/{job_id}").status_code == 200  # the server is fine


def test_json_that_parses_but_nests_deep_is_refused_by_validation(
    api: Api, unchanged: None
) -> None:
    deep = "[" * 500 + "]" * 500
    r = api.post("/v1/jobs", content=f'{{"precision": {{"policy": {deep}}}}}', headers=JSON)
    _refused(r, 422, "precision.policy")
    sweep = f'{{"policies": ["float32"], "variants": [{{"precision": {{"policy": {deep}}}}}]}}'
    r = api.post("/v1/sweeps", content=sweep, headers=JSON)
    _refused(r, 422, "variants.0.precision.policy")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"name": "caf\xe9"}', "not valid UTF-8"),
        (b'{"name": "\xc3\x28"}', "not valid UTF-8"),
        (b'{"training": {"epochs": ' + b"9" * 5000 + b"}}", "number literal too long"),
        (b'{"name": "a"', "invalid JSON"),
        (b"", None),
    ],
    ids=["latin-1", "broken-utf-8", "5000-digit-int", "truncated", "empty"],
)
def test_unparseable_bodies_are_422_naming_the_body(
    api: Api, unchanged: None, body: bytes, message: str | None
) -> None:
    for path in ("/v1/jobs", "/v1/sweeps"):
        r = api.post(path, content=body, headers=JSON)
        found = _refused(r, 422, "body")
        if message is not None:
            assert message in found["message"], found


def test_a_body_that_is_not_declared_json_is_refused(api: Api, unchanged: None) -> None:
    r = api.post("/v1/jobs", content=b"{}", headers={"Content-Type": "text/plain"})
    _refused(r, 422, "body")


@pytest.mark.parametrize("body", ["[]", '"spec"', "null", "42", "true", "[{}]"])
def test_a_body_that_is_not_an_object_is_422_naming_the_body(
    api: Api, db: Database, settings: Settings, body: str
) -> None:
    job_id = _submit(api)
    before = _stored(db, settings)
    for method, path in BODY_ROUTES:
        r = api.request(method, path.format(id=job_id), content=body, headers=JSON)
        _refused(r, 422, "body")
    assert _stored(db, settings) == before


# --------------------------------------------------------------------------------------------
# Huge numbers and strings, NaN and Infinity, unknown fields and wrong types in the places
# test_spec_validation.py does not reach (sweeps, PATCH, huge literals)

BIG = "1" + "0" * 1000  # 10**1000 as a JSON integer literal

REFUSED_BODIES: list[tuple[str, str, str, str, str]] = [
    # (case, path, raw JSON body, field, rule)
    (
        "1e400 is infinity",
        "/v1/jobs",
        '{"loss_scale": {"initial_scale": 1e400}}',
        "loss_scale.initial_scale",
        "finite_number",
    ),
    (
        "-1e400",
        "/v1/jobs",
        '{"optimizer": {"learning_rate": -1e400}}',
        "optimizer.learning_rate",
        "finite_number",
    ),
    (
        "10**1000 epochs",
        "/v1/jobs",
        f'{{"training": {{"epochs": {BIG}}}}}',
        "training.epochs",
        "less_than_equal",
    ),
    ("-10**1000 priority", "/v1/jobs", f'{{"priority": -{BIG}}}', "priority", "greater_than_equal"),
    (
        "10**1000 fault step",
        "/v1/jobs",
        f'{{"faults": {{"nonfinite_at_steps": [{BIG}]}}}}',
        "faults.nonfinite_at_steps.0",
        "less_than_equal",
    ),
    (
        "10**1000 as a float",
        "/v1/jobs",
        f'{{"data": {{"separation": {BIG}.5}}}}',
        "data.separation",
        "finite_number",
    ),
    (
        "huge string name",
        "/v1/jobs",
        json.dumps({"name": "x" * 500_000}),
        "name",
        "string_too_long",
    ),
    (
        "huge string policy",
        "/v1/jobs",
        json.dumps({"precision": {"policy": "m" * 500_000}}),
        "precision.policy",
        "literal_error",
    ),
    (
        "NUL in a job name",
        "/v1/jobs",
        json.dumps({"name": "a\x00b"}),
        "name",
        "string_pattern_mismatch",
    ),
    (
        "newline in a job name",
        "/v1/jobs",
        json.dumps({"name": "a\nb"}),
        "name",
        "string_pattern_mismatch",
    ),
    ("lone surrogate in a name", "/v1/jobs", '{"name": "a\\ud800b"}', "name", "string_unicode"),
    (
        "wrong section type",
        "/v1/jobs",
        '{"precision": "mixed_float16"}',
        "precision",
        "model_attributes_type",
    ),
    ("model as a list", "/v1/jobs", '{"model": [784, 128, 10]}', "model", "model_attributes_type"),
    (
        "fractional batch",
        "/v1/jobs",
        '{"training": {"batch_size": 32.5}}',
        "training.batch_size",
        "int_type",
    ),
    (
        "steps as a string",
        "/v1/jobs",
        '{"faults": {"nonfinite_at_steps": "1,2"}}',
        "faults.nonfinite_at_steps",
        "list_type",
    ),
    (
        "65 hidden layers",
        "/v1/jobs",
        json.dumps({"model": {"hidden": [8] * 65}}),
        "model.hidden",
        "too_long",
    ),
    (
        "10001 fault steps",
        "/v1/jobs",
        json.dumps({"faults": {"nonfinite_at_steps": list(range(10_001))}}),
        "faults.nonfinite_at_steps",
        "too_long",
    ),
    (
        "NaN target loss",
        "/v1/sweeps",
        '{"policies": ["float32"], "target_loss": NaN}',
        "target_loss",
        "finite_number",
    ),
    (
        "1e400 target loss",
        "/v1/sweeps",
        '{"policies": ["float32"], "target_loss": 1e400}',
        "target_loss",
        "finite_number",
    ),
    (
        "Infinity in a variant",
        "/v1/sweeps",
        '{"variants": [{"loss_scale": {"initial_scale": Infinity}}]}',
        "variants.0.loss_scale.initial_scale",
        "finite_number",
    ),
    (
        "-Infinity in the base",
        "/v1/sweeps",
        '{"policies": ["float32"], "base": {"optimizer": {"learning_rate": -Infinity}}}',
        "base.optimizer.learning_rate",
        "finite_number",
    ),
    (
        "unknown sweep field",
        "/v1/sweeps",
        '{"policies": ["float32"], "epochs": 3}',
        "epochs",
        "extra_forbidden",
    ),
    (
        "unknown variant field",
        "/v1/sweeps",
        '{"variants": [{"dropout": 0.5}]}',
        "variants.0.dropout",
        "extra_forbidden",
    ),
    (
        "unknown field in a variant section",
        "/v1/sweeps",
        '{"variants": [{"precision": {"policy": "float32", "dtype": "half"}}]}',
        "variants.0.precision.dtype",
        "extra_forbidden",
    ),
    (
        "unknown base field",
        "/v1/sweeps",
        '{"policies": ["float32"], "base": {"epochs": 3}}',
        "base.epochs",
        "extra_forbidden",
    ),
    ("policies not a list", "/v1/sweeps", '{"policies": "float32"}', "policies", "list_type"),
    ("21 variants", "/v1/sweeps", json.dumps({"variants": [{}] * 21}), "variants", "too_long"),
    (
        "NUL in a sweep name",
        "/v1/sweeps",
        json.dumps({"name": "a\x00", "policies": ["float32"]}),
        "name",
        "string_pattern_mismatch",
    ),
    (
        "NUL in a variant name",
        "/v1/sweeps",
        json.dumps({"variants": [{"name": "\x00"}]}),
        "variants.0.name",
        "string_pattern_mismatch",
    ),
    # Sweep jobs are named '<sweep>/<variant>' in a 200-character column.
    (
        "sweep name too long for its jobs' names",
        "/v1/sweeps",
        json.dumps({"name": "s" * 100, "policies": ["float32"]}),
        "name",
        "string_too_long",
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "body", "field", "rule"),
    REFUSED_BODIES,
    ids=[c[0] for c in REFUSED_BODIES],
)
def test_bad_values_are_422_naming_the_field_and_store_nothing(
    api: Api, unchanged: None, case: str, path: str, body: str, field: str, rule: str
) -> None:
    r = api.post(path, content=body, headers=JSON)
    _refused(r, 422, field, rule)


PATCHES: list[tuple[str, str, str, str]] = [
    ("NaN priority", '{"priority": NaN}', "priority", "int_type"),
    ("10**1000 priority", f'{{"priority": {BIG}}}', "priority", "less_than_equal"),
    ("priority as a word", '{"priority": "high"}', "priority", "int_type"),
    ("changing the owner", '{"priority": 60, "owner": "bob"}', "owner", "extra_forbidden"),
    ("changing the status", '{"priority": 60, "status": "succeeded"}', "status", "extra_forbidden"),
    ("no priority", "{}", "priority", "missing"),
]


@pytest.mark.parametrize(("case", "body", "field", "rule"), PATCHES, ids=[p[0] for p in PATCHES])
def test_bad_patches_are_422_and_change_nothing(
    api: Api, case: str, body: str, field: str, rule: str
) -> None:
    job_id = _submit(api)
    before = api.get(f"/v1/jobs/{job_id}").json()
    r = api.patch(f"/v1/jobs/{job_id}", content=body, headers=JSON)
    _refused(r, 422, field, rule)
    assert api.get(f"/v1/jobs/{job_id}").json() == before


def test_longest_names_fit_a_sweep_jobs_name(api: Api, db: Database) -> None:
    r = api.post("/v1/sweeps", json={"name": "s" * 99, "variants": [{"name": "v" * 100}]})
    assert r.status_code == 201, r.text
    job = api.get(f"/v1/jobs/{r.json()['variants'][0]['job_id']}").json()
    assert job["name"] == "s" * 99 + "/" + "v" * 100


# --------------------------------------------------------------------------------------------
# Absurd sizes: refused at submission, naming the limit (more in test_spec_validation.py)


ABSURD: list[tuple[str, str, dict[str, Any], str, str]] = [
    (
        "10**12 total steps",
        "/v1/jobs",
        {"training": {"epochs": 100_000, "steps_per_epoch": 10_000_000}},
        "training.epochs",
        "HALFWAY_MAX_TOTAL_STEPS",
    ),
    (
        "10**13 dataset values",
        "/v1/jobs",
        {"data": {"samples": 10_000_000, "features": 1_000_000}, "model": {"input_size": 10**6}},
        "data.samples",
        "HALFWAY_MAX_DATASET_ELEMENTS",
    ),
    (
        "a sweep of 10**12 steps",
        "/v1/sweeps",
        {
            "policies": ["float32", "mixed_bfloat16"],
            "base": {"training": {"epochs": 100_000, "steps_per_epoch": 10_000_000}},
        },
        "variants.0.training.epochs",
        "HALFWAY_MAX_TOTAL_STEPS",
    ),
    (
        "a sweep of a 10**12-parameter model",
        "/v1/sweeps",
        {
            "policies": ["float32"],
            "base": {
                "model": {"input_size": 1_000_000, "hidden": [65536] * 20},
                "data": {"features": 1_000_000, "samples": 2},
            },
        },
        "variants.0.model",
        "HALFWAY_MAX_PARAMETERS",
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "spec", "field", "setting"), ABSURD, ids=[a[0] for a in ABSURD]
)
def test_absurd_sizes_are_refused_naming_the_limit(
    api: Api, unchanged: None, case: str, path: str, spec: dict[str, Any], field: str, setting: str
) -> None:
    found = _refused(api.post(path, json=spec), 422, field, "limit")
    assert setting in found["message"]


# --------------------------------------------------------------------------------------------
# Paths out of the data directory, and pickles


def _outside(tmp_path: Path) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir(exist_ok=True)
    (folder / "secret.npz").write_bytes(_good_npz())
    return folder


def test_a_symlink_out_of_the_data_directory_is_refused(
    api: Api, db: Database, settings: Settings, tmp_path: Path
) -> None:
    outside = _outside(tmp_path)
    data_dir = settings.resolved_data_dir()
    (data_dir / "link.npz").symlink_to(outside / "secret.npz")
    (data_dir / "linkdir").symlink_to(outside, target_is_directory=True)
    before = _stored(db, settings)
    for path in ("link.npz", "linkdir/secret.npz", "linkdir/../linkdir/secret.npz"):
        r = api.post("/v1/jobs", json={"data": {"kind": "npz", "path": path}})
        _refused(r, 422, "data.path", "outside_data_dir")
    assert _stored(db, settings) == before
    # The worker checks again, on the file it opens.
    for path in ("link.npz", "linkdir/secret.npz", "../outside/secret.npz", str(outside)):
        with pytest.raises(JobError, match="escapes the data directory"):
            load_arrays({"kind": "npz", "path": path}, {}, data_dir)


@pytest.mark.parametrize(
    ("path", "rule"),
    [
        ("sub/../../outside/secret.npz", "outside_data_dir"),
        ("./../outside/secret.npz", "outside_data_dir"),
        ("//etc/x.npz", "outside_data_dir"),
        ("a\x00.npz", "path"),
        ("..", "outside_data_dir"),
        ("sub/", "npz"),
    ],
)
def test_paths_that_escape_are_refused(
    api: Api, tmp_path: Path, unchanged: None, path: str, rule: str
) -> None:
    _outside(tmp_path)
    r = api.post("/v1/jobs", json={"data": {"kind": "npz", "path": path}})
    _refused(r, 422, "data.path", rule)


def _pickles(marker: Path) -> dict[str, bytes]:
    """Files named .npz that hold pickles, each a trap that touches ``marker`` if loaded."""
    trap = _Trap(marker)
    member = io.BytesIO()
    with zipfile.ZipFile(member, "w") as z:
        z.writestr("x_train.npy", pickle.dumps(trap))
        z.writestr("y_train.npy", pickle.dumps(trap))
    return {
        "a pickle renamed .npz": pickle.dumps({"x_train": trap, "y_train": trap}),
        "a zip of pickles": member.getvalue(),
        "object arrays": _npz(
            x_train=np.array([trap] * 3, dtype=object), y_train=np.zeros(3, np.int64)
        ),
    }


def test_the_pickle_trap_springs_when_unpickled(marker: Path) -> None:
    """So the marker checks below mean something."""
    pickle.loads(_pickles(marker)["a pickle renamed .npz"])
    assert marker.exists()
    marker.unlink()


PICKLE_KINDS = ["a pickle renamed .npz", "a zip of pickles", "object arrays"]
PICKLE_RULES = {"a pickle renamed .npz": "not_npz", "a zip of pickles": "not_npz"}


@pytest.mark.parametrize("kind", ["a pickle renamed .npz", "a zip of pickles"])
def test_a_pickle_posing_as_npz_is_refused_as_an_upload_and_never_loaded(
    api: Api, unchanged: None, marker: Path, kind: str
) -> None:
    # (Object arrays in a real .npz: tests/test_team.py.)
    _refused(_upload(api, "trap", _pickles(marker)[kind]), 422, "file", "not_npz")


@pytest.mark.parametrize("kind", PICKLE_KINDS)
def test_a_pickle_in_the_data_directory_is_refused_at_submission(
    api: Api, db: Database, settings: Settings, marker: Path, kind: str
) -> None:
    (settings.resolved_data_dir() / "trap.npz").write_bytes(_pickles(marker)[kind])
    before = _stored(db, settings)
    r = api.post("/v1/jobs", json={"data": {"kind": "npz", "path": "trap.npz"}})
    _refused(r, 422, "data.path", PICKLE_RULES.get(kind, "pickle"))
    assert _stored(db, settings) == before


# "a zip of pickles" is left out: np.load hands back such a member as raw bytes (nothing is
# unpickled), but workers.data then fails on them with an AttributeError, not a JobError.
@pytest.mark.parametrize("kind", ["a pickle renamed .npz", "object arrays"])
def test_the_training_child_refuses_a_pickle_with_allow_pickle_off(
    settings: Settings, marker: Path, kind: str
) -> None:
    """A file queued before it was swapped for a pickle: the child fails the job with a reason
    instead of running the pickle."""
    data_dir = settings.resolved_data_dir()
    (data_dir / "trap.npz").write_bytes(_pickles(marker)[kind])
    with pytest.raises(JobError, match=r"trap.npz is not a plain-array .npz .*allow_pickle"):
        load_arrays({"kind": "npz", "path": "trap.npz"}, {}, data_dir)


ZIPS = {
    "encrypted member": (_patched_zip(flags=0x1), "not_npz"),
    "unsupported compression": (_patched_zip(method=99), "not_npz"),
    "corrupt local header": (_patched_zip(magic=b"XX\x03\x04"), "not_npz"),
    "five members": (
        _npz(**{k: np.zeros((3, 2)) for k in ("x_train", "y_train", "x_val", "y_val", "z")}),
        "arrays",
    ),
}


@pytest.mark.parametrize("case", ZIPS.keys())
def test_odd_zip_archives_are_422_not_500(
    api: Api, db: Database, settings: Settings, case: str
) -> None:
    content, rule = ZIPS[case]
    before = _stored(db, settings)
    _refused(_upload(api, "odd", content), 422, "file", rule)
    assert _stored(db, settings) == before
    # The same file dropped into the data directory is refused when a spec names it.
    (settings.resolved_data_dir() / "odd.npz").write_bytes(content)
    before = _stored(db, settings)
    r = api.post("/v1/jobs", json={"data": {"kind": "npz", "path": "odd.npz"}})
    _refused(r, 422, "data.path", rule)
    assert _stored(db, settings) == before


# --------------------------------------------------------------------------------------------
# Headers


@pytest.mark.parametrize(
    "key",
    [b"k" * 10_000, "clé".encode(), b"two words", b"tab\tbed", b"", "ключ".encode()],
    ids=["10k-chars", "accented", "space", "tab", "empty", "cyrillic"],
)
def test_bad_idempotency_keys_are_422_and_store_nothing(
    api: Api, unchanged: None, key: bytes
) -> None:
    r = api.post("/v1/jobs", json={}, headers={"Idempotency-Key": key})
    _refused(r, 422, "header.idempotency-key")


def test_a_reused_idempotency_key_is_409_naming_the_header(
    api: Api, db: Database, settings: Settings
) -> None:
    headers = {"Idempotency-Key": "nightly-1"}
    assert api.post("/v1/jobs", json={"name": "a"}, headers=headers).status_code == 201
    before = _stored(db, settings)
    r = api.post("/v1/jobs", json={"name": "b"}, headers=headers)
    _refused(r, 409, "Idempotency-Key", "conflict")
    assert _stored(db, settings) == before


def test_a_taken_dataset_name_is_409_naming_it(api: Api, db: Database, settings: Settings) -> None:
    assert _upload(api, "taken", _good_npz()).status_code == 201
    before = _stored(db, settings)
    _refused(_upload(api, "taken", _good_npz()), 409, "name", "conflict")
    assert _stored(db, settings) == before


@pytest.mark.parametrize(
    "value",
    [b"Bearer " + b"x" * 100_000, "Bearer clé".encode(), b"Bearer", b"Bearer   ", b"hw_only"],
    ids=["100k-token", "non-ascii", "no-token", "blank-token", "no-scheme"],
)
def test_bad_authorization_headers_are_401(api: Api, unchanged: None, value: bytes) -> None:
    r = api.client.post(
        "/v1/jobs",
        json={},
        headers={"Authorization": value},
    )
    assert r.status_code == 401, r.text
    assert r.json()["error"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"


# --------------------------------------------------------------------------------------------
# Query and path parameters on every list and history endpoint

BAD_QUERIES: list[tuple[str, str]] = [
    # (path with {id} for a job, parameter that breaks the rule)
    ("/v1/jobs", "status=bogus"),
    ("/v1/jobs", "limit=0"),
    ("/v1/jobs", "limit=201"),
    ("/v1/jobs", "limit=ten"),
    ("/v1/jobs", f"limit={BIG}"),
    ("/v1/jobs", "cursor=-1"),
    ("/v1/jobs", "cursor=abc"),
    ("/v1/jobs", "cursor=1e3"),
    ("/v1/jobs", "cursor=1234567890123"),
    ("/v1/jobs", "owner=" + "o" * 65),
    ("/v1/jobs/{id}/history", "after_step=abc"),
    ("/v1/jobs/{id}/history", f"after_step={2**31}"),
    ("/v1/jobs/{id}/history", "limit=0"),
    ("/v1/jobs/{id}/history", "points=abc"),
    ("/v1/jobs/{id}/history", "points=10&from_step=-1"),
    ("/v1/jobs/{id}/history", f"points=10&to_step={BIG}"),
    ("/v1/jobs/{id}/history", "limit=10001"),
    ("/v1/jobs/{id}/history", "format=columns&limit=1000001"),
    ("/v1/jobs/{id}/history", "format=arrow"),
    ("/v1/jobs/{id}/history.arrow", "from_step=-1"),
    ("/v1/jobs/{id}/history.arrow", "from_step=5&to_step=4"),
    ("/v1/jobs/{id}/history.parquet", f"to_step={2**31}"),
    ("/v1/jobs/{id}/history.parquet", "from_step=abc"),
    ("/v1/jobs/{id}/loss-scale/events", "after_step=-2"),
    ("/v1/jobs/{id}/loss-scale/events", "limit=0"),
    ("/v1/jobs/{id}/loss-scale/events", "limit=10001"),
    ("/v1/jobs/{id}/events", "after_step=-2"),
    ("/v1/jobs/{id}/events", "after_step=NaN"),
    ("/v1/jobs/{id}/logs", "offset=-1"),
    ("/v1/jobs/{id}/logs", "tail=0"),
    ("/v1/jobs/{id}/logs", f"tail={2**23}"),
    ("/v1/jobs/{id}/logs", f"offset={BIG}"),
    ("/v1/history", ""),
    ("/v1/history", "job_ids="),
    ("/v1/history", "job_ids=a"),
    ("/v1/history", "job_ids={id},,{id}"),
    ("/v1/history", "job_ids=" + ",".join(["{id}"] * 21)),
    ("/v1/history", "job_ids=0"),
    ("/v1/history", f"job_ids={2**31}"),
    ("/v1/history", "job_ids=12345678901"),
    ("/v1/history", "job_ids={id}&points=0"),
    ("/v1/history", "job_ids={id}&from_step=-1"),
]


@pytest.mark.parametrize(("path", "query"), BAD_QUERIES, ids=[f"{p}?{q}" for p, q in BAD_QUERIES])
def test_bad_query_parameters_are_422_naming_the_parameter(
    api: Api, db: Database, settings: Settings, path: str, query: str
) -> None:
    job_id = _submit(api)
    before = _stored(db, settings)
    url = f"{path}?{query}".format(id=job_id)
    r = api.get(url)
    assert r.status_code == 422, r.text
    named = [f for f, _ in _fields(r)]
    parameter = query.split("&")[-1].split("=")[0] or "job_ids"
    assert {f"query.{parameter}", parameter} & set(named), named
    assert _stored(db, settings) == before


JOB_PATHS = [
    ("GET", "/v1/jobs/{id}"),
    ("PATCH", "/v1/jobs/{id}"),
    ("POST", "/v1/jobs/{id}/cancel"),
    ("GET", "/v1/jobs/{id}/history"),
    ("GET", "/v1/jobs/{id}/history.csv"),
    ("GET", "/v1/jobs/{id}/history.arrow"),
    ("GET", "/v1/jobs/{id}/history.parquet"),
    ("GET", "/v1/jobs/{id}/loss-scale/events"),
    ("GET", "/v1/jobs/{id}/events"),
    ("GET", "/v1/jobs/{id}/artifacts"),
    ("GET", "/v1/jobs/{id}/artifacts/model.keras"),
    ("GET", "/v1/jobs/{id}/logs"),
    ("GET", "/v1/sweeps/{id}"),
]
BAD_IDS = ["0", "-1", "abc", "1.5", str(2**31), str(2**63), BIG]


@pytest.mark.parametrize(("method", "path"), JOB_PATHS, ids=[f"{m} {p}" for m, p in JOB_PATHS])
def test_ids_that_cannot_exist_are_422_not_500(
    api: Api, unchanged: None, method: str, path: str
) -> None:
    for bad in BAD_IDS:
        r = api.request(method, path.format(id=bad), json={"priority": 1})
        assert r.status_code == 422, (bad, r.text)
        assert [f for f, _ in _fields(r)] in (["path.job_id"], ["path.sweep_id"]), bad


def test_largest_id_is_a_plain_404(api: Api) -> None:
    r = api.get(f"/v1/jobs/{2**31 - 1}")
    assert r.status_code == 404 and r.json()["error"] == "not_found"


def test_owner_filter_with_a_nul_byte_matches_nobody(api: Api) -> None:
    _submit(api)
    r = api.get("/v1/jobs?owner=alice%00")
    assert r.status_code == 200, r.text
    assert r.json() == {"items": [], "next_cursor": None}


def test_a_cursor_beyond_every_id_lists_from_the_newest(api: Api) -> None:
    ids = [_submit(api) for _ in range(3)]
    r = api.get("/v1/jobs?cursor=999999999999")
    assert r.status_code == 200, r.text
    assert [j["id"] for j in r.json()["items"]] == ids[::-1]
