"""What can go wrong talking to Halfway, as typed exceptions. Each carries the exit code the
``halfway`` command exits with for it (``ExitCode``, the only place the codes are defined)."""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Any, ClassVar


class ExitCode(IntEnum):
    OK = 0
    JOB_FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    UNAUTHORIZED = 4
    FORBIDDEN = 5
    NOT_FOUND = 6
    CONFLICT = 7
    INVALID = 8
    SERVER_ERROR = 9
    JOB_CANCELLED = 10
    INTERRUPTED = 130


class HalfwayError(Exception):
    """A failure to report: one line of message, optional detail lines, an exit code."""

    code: ClassVar[ExitCode] = ExitCode.SERVER_ERROR

    def __init__(self, message: str, details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.details = list(details)


class UsageError(HalfwayError):
    """Bad arguments, an unreadable spec or config file, a malformed URL."""

    code = ExitCode.USAGE


class Unreachable(HalfwayError):
    """The server cannot be reached (refused, unknown host, timed out)."""

    code = ExitCode.UNREACHABLE


class Unauthorized(HalfwayError):
    """401: the token is missing or invalid."""

    code = ExitCode.UNAUTHORIZED


class Forbidden(HalfwayError):
    """403: the token is valid but may not do this."""

    code = ExitCode.FORBIDDEN


class NotFound(HalfwayError):
    """404: no such job, sweep or artifact."""

    code = ExitCode.NOT_FOUND


class Conflict(HalfwayError):
    """409: cancel of a finished job, an Idempotency-Key reused with another spec."""

    code = ExitCode.CONFLICT


class Invalid(HalfwayError):
    """400/413/422: the server refused the input. ``fields`` holds each field the server
    named, as ``{"field": ..., "message": ..., "rule": ...}``."""

    code = ExitCode.INVALID

    def __init__(
        self,
        message: str,
        details: Sequence[str] = (),
        fields: Sequence[dict[str, Any]] = (),
    ) -> None:
        super().__init__(message, details)
        self.fields = list(fields)


class ServerError(HalfwayError):
    """5xx, or an answer this client does not understand."""

    code = ExitCode.SERVER_ERROR
