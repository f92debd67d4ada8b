"""ETags for polled resources: a dashboard sends If-None-Match and gets an empty 304 while
nothing changed, which saves the body's bytes and the client's parsing."""

from __future__ import annotations

import hashlib
import json

from fastapi import Request, Response
from pydantic import BaseModel


def etag_of(body: bytes, history_version: int | None = None) -> str:
    """A strong ETag of the body. A history or bucket page's starts with its job's history
    version (``"h2-..."``), so a client can tell which version a 304 stands for."""
    digest = hashlib.blake2b(body, digest_size=16).hexdigest()
    return f'"h{history_version}-{digest}"' if history_version is not None else f'"{digest}"'


def serialize(model: BaseModel) -> bytes:
    return json.dumps(
        model.model_dump(mode="json"), separators=(",", ":"), allow_nan=False
    ).encode()


def matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    if header.strip() == "*":
        return True
    candidates = [c.strip().removeprefix("W/") for c in header.split(",")]
    return etag in candidates


def respond(
    request: Request, body: bytes, etag: str, *, media_type: str = "application/json"
) -> Response:
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    return Response(content=body, media_type=media_type, headers=headers)


def etag_response(
    request: Request, model: BaseModel, *, media_type: str = "application/json"
) -> Response:
    body = serialize(model)
    return respond(request, body, etag_of(body), media_type=media_type)
