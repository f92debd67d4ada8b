"""Job spec files for the client: YAML or JSON, or ``-`` for stdin."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from service.client.errors import UsageError


class SpecLoader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; the API takes JSON types strictly, so a
    learning rate written that way would be a 422. Read it as the number it is, as YAML 1.2
    does."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_spec(path: str) -> dict[str, Any]:
    """A spec from a YAML or JSON file (by suffix; else JSON, then YAML), or ``-`` for stdin."""
    name = "stdin" if path == "-" else path
    text = _read_spec_text(path)
    if not text.strip():
        raise UsageError(f"spec file {name} is empty")
    data = _parse_spec(text, Path(path).suffix.lower(), name)
    if not isinstance(data, dict):
        raise UsageError(
            f"spec file {name} must hold a mapping of sections (model, data, training, ...), "
            f"not {type(data).__name__}"
        )
    # YAML may hold dates and the like; the API takes JSON, so make them strings now.
    spec: dict[str, Any] = json.loads(json.dumps(data, default=str))
    return spec


def _read_spec_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"spec file {path} not found") from None
    except IsADirectoryError:
        raise UsageError(f"spec file {path} is a directory") from None
    except UnicodeDecodeError:
        raise UsageError(f"spec file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise UsageError(f"cannot read spec file {path}: {exc.strerror}") from None


def _parse_spec(text: str, suffix: str, name: str) -> Any:
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"spec file {name} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                f"column {exc.colno}"
            ) from None
    try:
        return yaml.load(text, Loader=SpecLoader)  # a SafeLoader; YAML 1.1 reads JSON too
    except yaml.YAMLError as exc:
        kind = "YAML" if suffix in (".yaml", ".yml") else "JSON or YAML"
        raise UsageError(f"spec file {name} is not valid {kind}", [str(exc)]) from None
