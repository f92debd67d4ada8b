"""Where the server is and which token to send. Each is looked up on its own, first found wins:

1. the arguments (the command's ``--url`` / ``--token``, or ``Client(url=..., token=...)``);
2. the environment: ``HALFWAY_URL`` / ``HALFWAY_TOKEN``;
3. a config file with ``url`` and ``token`` keys: ``$HALFWAY_CONFIG`` if set (it must exist),
   else ``~/.config/halfway/client.toml``, ``client.yaml`` or ``client.yml`` (``~/.config`` is
   ``$XDG_CONFIG_HOME`` when that is set);
4. the URL defaults to ``http://127.0.0.1:8000``; there is no default token.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import stat
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from service.client.errors import UsageError

DEFAULT_URL = "http://127.0.0.1:8000"
CONFIG_KEYS = frozenset({"url", "token"})
CONFIG_NAMES = ("client.toml", "client.yaml", "client.yml")


@dataclass(frozen=True)
class Target:
    url: str
    token: str | None
    token_source: str | None  # where the token came from, for a 401's message


def config_file(env: Mapping[str, str]) -> Path | None:
    """The config file to read, or None. An explicit ``HALFWAY_CONFIG`` must exist."""
    explicit = env.get("HALFWAY_CONFIG")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise UsageError(f"config file {path} (from HALFWAY_CONFIG) not found")
        return path
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return next((p for p in (base / "halfway" / n for n in CONFIG_NAMES) if p.is_file()), None)


def read_config(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read config file {path}: {exc}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold 'url' and 'token' keys")
    unknown = sorted(set(data) - CONFIG_KEYS)
    if unknown:
        raise UsageError(
            f"config file {path}: unknown key(s) {', '.join(unknown)}; known: url, token"
        )
    for key, value in data.items():
        if not isinstance(value, str):
            raise UsageError(f"config file {path}: {key} must be a string")
    if "token" in data:
        _warn_if_readable_by_others(path)
    return dict(data)


def _warn_if_readable_by_others(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            print(
                f"warning: {path} holds a token and other users can read it; run: "
                f"chmod 600 {shlex.quote(str(path))}",
                file=sys.stderr,
            )


def resolve_target(
    url: str | None, token: str | None, env: Mapping[str, str] | None = None
) -> Target:
    """Argument, then environment, then config file, then default. A config file that exists
    is always read, so a broken one is reported even when arguments override it."""
    env = os.environ if env is None else env
    found: dict[str, tuple[str, str]] = {}
    for key, flag, var in (("url", url, "HALFWAY_URL"), ("token", token, "HALFWAY_TOKEN")):
        if flag:
            found[key] = (flag, f"--{key}")
        elif env.get(var):
            found[key] = (env[var], var)
    path = config_file(env)
    if path is not None:
        for key, value in read_config(path).items():
            found.setdefault(key, (value, f"config file {path}"))
    raw_url, url_source = found.get("url", (DEFAULT_URL, "default"))
    raw_token, token_source = found.get("token", (None, None))
    return Target(_check_url(raw_url, url_source), raw_token, token_source)


def _check_url(url: str, source: str) -> str:
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(
            f"invalid server URL {url!r} (from {source}): expected http://HOST:PORT, "
            f"e.g. {DEFAULT_URL}"
        )
    return url
