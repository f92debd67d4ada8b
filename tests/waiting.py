"""Waiting as a client does. With the poll cache on (as in production), what the API says
about a job lags a write made behind its back (by a worker, or a test writing straight into
the database) by up to ``HALFWAY_POLL_CACHE_SECONDS``; a test reads until the answer comes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(read: Callable[[], T], ok: Callable[[T], bool], timeout: float = 10.0) -> T:
    """Read until ``ok`` holds; fail with the last answer after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"still {value!r}"
        time.sleep(0.05)
