"""The OpenAPI document, as strict as the validation behind it.

Some inputs are taken raw and validated later, for good reason: a sweep's ``base`` is a job
spec and each variant's ``precision`` and ``loss_scale`` are merged into its sections before
the merged spec is validated. Pydantic can only describe them as "any object"; here they get
the schemas they are validated against, so a client (or a fuzzer) sees the same rules.
The document also carries links: a created job's id to every job operation, a sweep's to the
sweep and its first variant's job (for clients and for schemathesis' stateful phase).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

JOB_OPERATIONS = [
    ("GetJob", "get", "/v1/jobs/{job_id}"),
    ("PatchJob", "patch", "/v1/jobs/{job_id}"),
    ("CancelJob", "post", "/v1/jobs/{job_id}/cancel"),
    ("GetHistory", "get", "/v1/jobs/{job_id}/history"),
    ("GetHistoryCsv", "get", "/v1/jobs/{job_id}/history.csv"),
    ("GetScaleEvents", "get", "/v1/jobs/{job_id}/loss-scale/events"),
    ("GetArtifacts", "get", "/v1/jobs/{job_id}/artifacts"),
    ("GetLogs", "get", "/v1/jobs/{job_id}/logs"),
    ("CompareHistory", "get", "/v1/history"),
]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _links(paths: dict[str, Any], job_id: str) -> dict[str, Any]:
    links: dict[str, Any] = {}
    for name, method, path in JOB_OPERATIONS:
        operation = paths.get(path, {}).get(method)
        if operation is None:
            continue
        parameter = "job_ids" if path == "/v1/history" else "job_id"
        links[name] = {
            "operationId": operation["operationId"],
            "parameters": {parameter: job_id},
        }
    return links


def _input(schemas: dict[str, Any], name: str) -> str:
    """The component of a model as a request body takes it: pydantic names it ``NAME-Input``
    when the model serializes differently from how it validates (JobSpec drops what a code
    job does not have)."""
    return f"{name}-Input" if f"{name}-Input" in schemas else name


def tighten(document: dict[str, Any]) -> dict[str, Any]:
    """Idempotent: FastAPI regenerates the document when routes change."""
    schemas = document["components"]["schemas"]
    schemas["SweepSpec"]["properties"]["base"] = {
        **_ref(_input(schemas, "JobSpec")),
        "description": schemas["SweepSpec"]["properties"]["base"].get("description", ""),
    }
    for section, model in (("precision", "PrecisionSpec"), ("loss_scale", "LossScaleSpec")):
        schemas["VariantSpec"]["properties"][section] = {
            "anyOf": [_ref(_input(schemas, model)), {"type": "null"}]
        }
    paths = document["paths"]
    created_job = paths["/v1/jobs"]["post"]["responses"]["201"]
    created_job["links"] = _links(paths, "$response.body#/id")
    created_sweep = paths["/v1/sweeps"]["post"]["responses"]["201"]
    created_sweep["links"] = {
        "GetSweep": {
            "operationId": paths["/v1/sweeps/{sweep_id}"]["get"]["operationId"],
            "parameters": {"sweep_id": "$response.body#/id"},
        },
        **{
            f"Variant{name}": link
            for name, link in _links(paths, "$response.body#/variants/0/job_id").items()
        },
    }
    return document


def install(app: FastAPI) -> None:
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        return tighten(generate())

    app.openapi = openapi  # type: ignore[method-assign]
