"""Halfway's Python client: ``from service.client import Client``.

It needs only httpx (and pandas for the DataFrames of ``Client.history``, ``Client.metrics``,
``Client.gradients`` and ``Client.sweep``, matplotlib to plot them:
``pip install 'halfway[client]'``); it never imports the server, SQLAlchemy or TensorFlow."""

from service.client.api import Client
from service.client.config import Target, resolve_target
from service.client.errors import (
    Conflict,
    ExitCode,
    Forbidden,
    HalfwayError,
    Invalid,
    NotFound,
    ServerError,
    Unauthorized,
    Unreachable,
    UsageError,
)

__all__ = [
    "Client",
    "Conflict",
    "ExitCode",
    "Forbidden",
    "HalfwayError",
    "Invalid",
    "NotFound",
    "ServerError",
    "Target",
    "Unauthorized",
    "Unreachable",
    "UsageError",
    "resolve_target",
]
