"""How the server's answers become values or typed errors (``service.client.errors``): a JSON
body, a transport failure, and Halfway's error JSON with its fields, each with what to try."""

from __future__ import annotations

from typing import Any

import httpx

from service.client import errors
from service.client.config import Target


def response_json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        raise errors.ServerError(
            f"{response.request.url} answered {response.status_code} with something that is "
            "not JSON; is the URL a Halfway server?"
        ) from None


def unreachable(url: str, exc: httpx.TransportError) -> errors.Unreachable:
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        reason = f"timed out ({reason})"
    return errors.Unreachable(
        f"cannot reach Halfway at {url}: {reason}",
        ["Is the server running (halfway serve)? Point elsewhere with --url or HALFWAY_URL."],
    )


def _error_body(response: httpx.Response) -> tuple[str, list[dict[str, Any]]]:
    """The message and fields of Halfway's error JSON; the text of anything else."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        fields = body.get("fields")
        message = body.get("message") or body.get("detail") or response.reason_phrase
        listed = fields if isinstance(fields, list) else []
        return str(message), [f for f in listed if isinstance(f, dict)]
    text = response.text.strip()[:300]
    return text or response.reason_phrase, []


def api_error(response: httpx.Response, target: Target) -> errors.HalfwayError:
    status = response.status_code
    message, fields = _error_body(response)
    if status == 401:
        sent = f"the token came from {target.token_source}" if target.token else "no token was sent"
        return errors.Unauthorized(
            "token missing or invalid; set HALFWAY_TOKEN or --token",
            [f"server said: {message} ({sent})"],
        )
    simple: dict[int, tuple[str, type[errors.HalfwayError]]] = {
        403: ("forbidden", errors.Forbidden),
        404: ("not found", errors.NotFound),
        409: ("conflict", errors.Conflict),
    }
    if status in simple:
        label, kind = simple[status]
        return kind(f"{label}: {message}")
    if status == 413:
        return errors.Invalid(f"too large: {message}")
    if status in (400, 422):
        details = [
            f"{f.get('field', '?')}: {f.get('message', '')} (rule: {f.get('rule', '?')})"
            for f in fields
        ]
        headline = "the server refused the input" + (":" if details else f": {message}")
        return errors.Invalid(headline, details, fields)
    return errors.ServerError(f"server error {status}: {message}")
