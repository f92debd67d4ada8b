"""Domain exceptions raised below the routes; ``service.api.app`` maps each to one HTTP status."""

from __future__ import annotations


class HalfwayError(Exception):
    status_code = 400
    code = "bad_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SpecError(HalfwayError):
    """A spec that is well-formed JSON but breaks a rule that needs context (limits, paths)."""

    status_code = 422
    code = "validation_error"

    def __init__(self, field: str, rule: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.rule = rule
        self.detail = message


class FieldErrors(HalfwayError):
    """Several fields broke rules at once (e.g. variants of a sweep)."""

    status_code = 422
    code = "validation_error"

    def __init__(self, fields: list[dict[str, str]]) -> None:
        super().__init__("; ".join(f"{f['field']}: {f['message']}" for f in fields[:5]))
        self.fields = fields


class NotFound(HalfwayError):
    status_code = 404
    code = "not_found"


class Conflict(HalfwayError):
    """Well-formed, but it clashes with what exists. ``field`` names the input that clashes,
    where one does (a reused Idempotency-Key, a dataset name that is taken)."""

    status_code = 409
    code = "conflict"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.fields = [{"field": field, "rule": "conflict", "message": message}] if field else []


class Unauthorized(HalfwayError):
    status_code = 401
    code = "unauthorized"


class Forbidden(HalfwayError):
    status_code = 403
    code = "forbidden"


class PayloadTooLarge(HalfwayError):
    status_code = 413
    code = "payload_too_large"


class TooManyRequests(HalfwayError):
    status_code = 429
    code = "too_many_requests"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after
