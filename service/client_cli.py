"""The ``halfway`` client commands: submit jobs and watch them, list and inspect jobs, read their
history and logs, cancel them, find their TensorBoard files. They talk to a running server
over HTTP (httpx) and print with rich; ``register(app)`` adds them to the ``halfway`` command.

Commands (each also takes ``--url`` and ``--token``)::

    halfway submit SPEC.yaml|SPEC.json|- [--watch] [--dry-run] [--idempotency-key K]
    halfway jobs [--status S] [--owner O] [--limit N] [--cursor C]
    halfway show ID [--json]
    halfway history ID [--after-step N] [--limit N] | --csv | --points P | --arrow F | --parquet F
    halfway cancel ID
    halfway logs ID [--follow]
    halfway tensorboard ID [--artifact-dir DIR]
    halfway sweep SPEC [--policies float32,mixed_float16,mixed_bfloat16] [--target-loss L]

Server and token, first found wins, each looked up on its own:

1. the command's ``--url`` / ``--token`` options;
2. the environment: ``HALFWAY_URL`` / ``HALFWAY_TOKEN``;
3. a config file with ``url`` and ``token`` keys: ``$HALFWAY_CONFIG`` if set (it must exist),
   else ``~/.config/halfway/client.toml``, ``client.yaml`` or ``client.yml`` (``~/.config`` is
   ``$XDG_CONFIG_HOME`` when that is set);
4. the URL defaults to ``http://127.0.0.1:8000``; there is no default token.

Exit codes (``ExitCode``, the only place they are defined):

===  =======================================================================================
0    success; for ``submit --watch``: the job succeeded
1    the watched job failed
2    usage: a bad option, an unreadable spec file, a bad config file or URL
3    cannot reach the server (connection refused, unknown host, timeout)
4    401: the token is missing or invalid
5    403: not allowed (only the job's owner or an admin may cancel it)
6    404: no such job
7    409: conflict (cancel of a finished job, an Idempotency-Key reused with another spec)
8    400/413/422: the server refused the input; each field and the rule it broke is printed
9    the server failed (5xx) or gave an answer this client does not understand
10   the watched job was cancelled
130  interrupted (Ctrl-C) while watching or following; the job itself keeps running
===  =======================================================================================

Errors go to stderr, results to stdout; ``history --csv`` and ``logs`` write the server's
bytes unchanged, so they pipe cleanly.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import stat
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import IntEnum, StrEnum
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, BinaryIO, ParamSpec, TypeAlias
from urllib.parse import urlsplit

import httpx
import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

Job: TypeAlias = dict[str, Any]
P = ParamSpec("P")


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


DEFAULT_URL = "http://127.0.0.1:8000"
CONFIG_KEYS = frozenset({"url", "token"})
CONFIG_NAMES = ("client.toml", "client.yaml", "client.yml")
FINISHED = frozenset({"succeeded", "failed", "cancelled"})
POLL_SECONDS = 1.0
# A watch survives a server restart or a database blip this long before giving up.
WATCH_PATIENCE_SECONDS = 60.0
TRANSIENT = frozenset({ExitCode.UNREACHABLE, ExitCode.SERVER_ERROR})
# Rich folds tables to 80 columns when stdout is not a terminal; a piped table stays whole.
PIPE_WIDTH = 160
PANEL = "Client (talk to a running server)"


class CliError(Exception):
    """A failure to report: one line of message, optional detail lines, an exit code."""

    def __init__(self, message: str, code: ExitCode, details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.details = list(details)


# --------------------------------------------------------------------------------------------
# Where the server is: flags, environment, config file


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
            raise CliError(f"config file {path} (from HALFWAY_CONFIG) not found", ExitCode.USAGE)
        return path
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return next((p for p in (base / "halfway" / n for n in CONFIG_NAMES) if p.is_file()), None)


def read_config(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise CliError(f"cannot read config file {path}: {exc}", ExitCode.USAGE) from None
    data = data or {}
    if not isinstance(data, dict):
        raise CliError(f"config file {path} must hold 'url' and 'token' keys", ExitCode.USAGE)
    unknown = sorted(set(data) - CONFIG_KEYS)
    if unknown:
        raise CliError(
            f"config file {path}: unknown key(s) {', '.join(unknown)}; known: url, token",
            ExitCode.USAGE,
        )
    for key, value in data.items():
        if not isinstance(value, str):
            raise CliError(f"config file {path}: {key} must be a string", ExitCode.USAGE)
    if "token" in data:
        _warn_if_readable_by_others(path)
    return dict(data)


def _warn_if_readable_by_others(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            err_console().print(
                f"[yellow]warning:[/] {escape(str(path))} holds a token and other users can "
                f"read it; run: chmod 600 {escape(shlex.quote(str(path)))}"
            )


def resolve_target(
    url: str | None, token: str | None, env: Mapping[str, str] | None = None
) -> Target:
    """Flag, then environment, then config file, then default. A config file that exists
    is always read, so a broken one is reported even when flags override it."""
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
        raise CliError(
            f"invalid server URL {url!r} (from {source}): expected http://HOST:PORT, "
            f"e.g. {DEFAULT_URL}",
            ExitCode.USAGE,
        )
    return url


# --------------------------------------------------------------------------------------------
# HTTP


class HalfwayClient:
    """The API calls the commands make. Every failure comes out as a ``CliError``."""

    def __init__(self, target: Target, timeout: float = 30.0) -> None:
        headers = {"User-Agent": "halfway-cli"}
        if target.token:
            headers["Authorization"] = f"Bearer {target.token}"
        self.target = target
        self._http = httpx.Client(
            base_url=target.url, headers=headers, timeout=httpx.Timeout(timeout, connect=5.0)
        )

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int | bool] | None = None,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        try:
            response = self._http.request(method, path, params=params, json=body, headers=headers)
        except httpx.TransportError as exc:
            raise unreachable(self.target.url, exc) from None
        if response.status_code >= 400:
            raise api_error(response, self.target)
        return response

    @contextlib.contextmanager
    def stream(self, path: str) -> Iterator[httpx.Response]:
        try:
            with self._http.stream("GET", path) as response:
                if response.status_code >= 400:
                    response.read()
                    raise api_error(response, self.target)
                yield response
        except httpx.TransportError as exc:
            raise unreachable(self.target.url, exc) from None

    def submit(
        self, spec: dict[str, Any], *, dry_run: bool = False, key: str | None = None
    ) -> tuple[dict[str, Any], bool]:
        """The job (or, for a dry run, the normalized spec) and whether it was a replay."""
        response = self.request(
            "POST",
            "/v1/jobs",
            params={"dry_run": "true"} if dry_run else None,
            body=spec,
            headers={"Idempotency-Key": key} if key else None,
        )
        return _json(response), response.headers.get("Idempotent-Replayed") == "true"

    def job(self, job_id: int, etag: str | None = None) -> tuple[Job | None, str | None]:
        """The job, or None when it has not changed since ``etag`` (a 304)."""
        response = self.request(
            "GET", f"/v1/jobs/{job_id}", headers={"If-None-Match": etag} if etag else None
        )
        if response.status_code == 304:
            return None, etag
        return _json(response), response.headers.get("ETag")

    def jobs(self, params: Mapping[str, str | int]) -> dict[str, Any]:
        page: dict[str, Any] = _json(self.request("GET", "/v1/jobs", params=params))
        return page

    def history(self, job_id: int, params: Mapping[str, int]) -> dict[str, Any]:
        page: dict[str, Any] = _json(
            self.request("GET", f"/v1/jobs/{job_id}/history", params=params)
        )
        return page

    def cancel(self, job_id: int) -> Job:
        job: Job = _json(self.request("POST", f"/v1/jobs/{job_id}/cancel"))
        return job

    def logs(self, job_id: int, offset: int | None) -> tuple[bytes, int]:
        """Log bytes from ``offset`` (None: the tail) and the offset to continue from."""
        params = {"offset": offset} if offset is not None else None
        response = self.request("GET", f"/v1/jobs/{job_id}/logs", params=params)
        try:
            after = int(response.headers["X-Log-Offset"])
        except (KeyError, ValueError):
            raise CliError(
                "the server sent no X-Log-Offset with the log", ExitCode.SERVER_ERROR
            ) from None
        return response.content, after

    def create_sweep(self, sweep: dict[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = _json(self.request("POST", "/v1/sweeps", body=sweep))
        return created

    def sweep(self, sweep_id: int) -> dict[str, Any]:
        table: dict[str, Any] = _json(self.request("GET", f"/v1/sweeps/{sweep_id}"))
        return table

    def artifacts(self, job_id: int) -> list[dict[str, Any]]:
        listed: list[dict[str, Any]] = _json(self.request("GET", f"/v1/jobs/{job_id}/artifacts"))
        return listed


@contextlib.contextmanager
def connect(url: str | None, token: str | None) -> Iterator[HalfwayClient]:
    client = HalfwayClient(resolve_target(url, token))
    try:
        yield client
    finally:
        client.close()


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        raise CliError(
            f"{response.request.url} answered {response.status_code} with something that is "
            "not JSON; is the URL a Halfway server?",
            ExitCode.SERVER_ERROR,
        ) from None


def unreachable(url: str, exc: httpx.TransportError) -> CliError:
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        reason = f"timed out ({reason})"
    return CliError(
        f"cannot reach Halfway at {url}: {reason}",
        ExitCode.UNREACHABLE,
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


def api_error(response: httpx.Response, target: Target) -> CliError:
    status = response.status_code
    message, fields = _error_body(response)
    if status == 401:
        sent = f"the token came from {target.token_source}" if target.token else "no token was sent"
        return CliError(
            "token missing or invalid; set HALFWAY_TOKEN or --token",
            ExitCode.UNAUTHORIZED,
            [f"server said: {message} ({sent})"],
        )
    simple = {
        403: ("forbidden", ExitCode.FORBIDDEN),
        404: ("not found", ExitCode.NOT_FOUND),
        409: ("conflict", ExitCode.CONFLICT),
        413: ("too large", ExitCode.INVALID),
    }
    if status in simple:
        label, code = simple[status]
        return CliError(f"{label}: {message}", code)
    if status in (400, 422):
        details = [
            f"{f.get('field', '?')}: {f.get('message', '')} (rule: {f.get('rule', '?')})"
            for f in fields
        ]
        headline = "the server refused the input" + (":" if details else f": {message}")
        return CliError(headline, ExitCode.INVALID, details)
    return CliError(f"server error {status}: {message}", ExitCode.SERVER_ERROR)


# --------------------------------------------------------------------------------------------
# Spec files


def load_spec(path: str) -> dict[str, Any]:
    """A spec from a YAML or JSON file (by suffix; else JSON, then YAML), or ``-`` for stdin."""
    name = "stdin" if path == "-" else path
    text = _read_spec_text(path)
    if not text.strip():
        raise CliError(f"spec file {name} is empty", ExitCode.USAGE)
    data = _parse_spec(text, Path(path).suffix.lower(), name)
    if not isinstance(data, dict):
        raise CliError(
            f"spec file {name} must hold a mapping of sections (model, data, training, ...), "
            f"not {type(data).__name__}",
            ExitCode.USAGE,
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
        raise CliError(f"spec file {path} not found", ExitCode.USAGE) from None
    except IsADirectoryError:
        raise CliError(f"spec file {path} is a directory", ExitCode.USAGE) from None
    except UnicodeDecodeError:
        raise CliError(f"spec file {path} is not UTF-8 text", ExitCode.USAGE) from None
    except OSError as exc:
        raise CliError(f"cannot read spec file {path}: {exc.strerror}", ExitCode.USAGE) from None


def _parse_spec(text: str, suffix: str, name: str) -> Any:
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise CliError(
                f"spec file {name} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                f"column {exc.colno}",
                ExitCode.USAGE,
            ) from None
    try:
        return yaml.safe_load(text)  # YAML 1.1 reads JSON too
    except yaml.YAMLError as exc:
        kind = "YAML" if suffix in (".yaml", ".yml") else "JSON or YAML"
        raise CliError(
            f"spec file {name} is not valid {kind}", ExitCode.USAGE, [str(exc)]
        ) from None


# --------------------------------------------------------------------------------------------
# Output


def err_console() -> Console:
    """Messages on stderr, never folded mid-line (they get grepped and pasted)."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


@dataclass
class Ui:
    out: Console
    err: Console

    @classmethod
    def create(cls) -> Ui:
        out = Console(highlight=False)
        if not out.is_terminal and "COLUMNS" not in os.environ:
            out = Console(highlight=False, width=PIPE_WIDTH)
        return cls(out=out, err=err_console())


def report(error: CliError) -> None:
    err = err_console()
    err.print(f"[bold red]error:[/] {escape(error.message)}")
    for line in error.details:
        err.print(f"  {escape(line)}")


def handles_errors(command: Callable[P, None]) -> Callable[P, None]:
    """Turn a ``CliError`` into its message and exit code, and Ctrl-C into 130."""

    @wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            command(*args, **kwargs)
        except CliError as exc:
            report(exc)
            raise typer.Exit(exc.code) from None
        except KeyboardInterrupt:
            err_console().print("\ninterrupted (the job itself keeps running)")
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        except BrokenPipeError:
            # The reader (head, less) has gone: stop quietly, and keep Python's final flush of
            # stdout from failing too.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(ExitCode.OK) from None

    return run


STATUS_STYLE = {
    "queued": "blue",
    "running": "cyan",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "yellow",
}


def styled_status(status: str) -> Text:
    return Text(status, style=STATUS_STYLE.get(status, ""))


def fmt_number(value: float | None, digits: int = 5) -> str:
    if value is None:
        return "-"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.{digits}g}"


def fmt_loss(value: float | None, nonfinite: str | None = None) -> str:
    return nonfinite if value is None and nonfinite else fmt_number(value)


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    moment = datetime.fromisoformat(value)
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def fmt_time(value: str | None) -> str:
    moment = parse_time(value)
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S") if moment else "-"


def fmt_duration(job: Job) -> str | None:
    start, end = parse_time(job.get("started_at")), parse_time(job.get("finished_at"))
    if start is None or end is None:
        return None
    return f"{(end - start).total_seconds():.1f} s"


def fmt_progress(progress: Mapping[str, Any]) -> str:
    step, total, fraction = progress.get("step"), progress.get("total_steps"), progress["fraction"]
    if step is None:
        return "-"
    if not total:
        return str(step)
    return f"{step}/{total} ({fraction:.0%})" if fraction is not None else f"{step}/{total}"


def fmt_epoch(job: Job) -> str:
    epoch = job["progress"].get("epoch")
    epochs = job.get("spec", {}).get("training", {}).get("epochs")
    if epoch is None:
        return "-"
    return f"{epoch + 1}/{epochs}" if epochs else str(epoch + 1)


def binary_stdout() -> BinaryIO:
    """Stdout's bytes, for output passed through unchanged (CSV, logs)."""
    sys.stdout.flush()
    return sys.stdout.buffer


def write_bytes(stream: BinaryIO, data: bytes) -> None:
    stream.write(data)
    stream.flush()


# --------------------------------------------------------------------------------------------
# submit


def print_submitted(ui: Ui, job: Job, replayed: bool, key: str | None) -> None:
    name = escape(job["name"])
    if replayed:
        ui.out.print(
            f"Job [bold]{job['id']}[/] ({name}) was already submitted with idempotency key "
            f"{escape(repr(key))}; nothing new was queued. It is {job['status']}."
        )
    else:
        ui.out.print(f"Submitted job [bold]{job['id']}[/] ({name}), {job['status']}.")
    print_remarks(ui, job.get("warnings", []), job.get("notes", []))


def print_remarks(ui: Ui, warnings: Sequence[str], notes: Sequence[str]) -> None:
    for warning in warnings:
        ui.out.print(f"[yellow]warning:[/] {escape(warning)}")
    for note in notes:
        ui.out.print(f"[dim]note:[/] {escape(note)}")


def print_dry_run(ui: Ui, result: dict[str, Any]) -> None:
    ui.out.print("[green]The spec is valid[/] (dry run: nothing was stored). Normalized spec:")
    ui.out.print_json(data=result["spec"])
    print_remarks(ui, result.get("warnings", []), result.get("notes", []))


def _bar_fields(job: Job) -> dict[str, Any]:
    summary = job["summary"]
    return {
        "job": f"job {job['id']}",
        "status": f"[{STATUS_STYLE.get(job['status'], '')}]{job['status']}[/]",
        "epoch": fmt_epoch(job),
        "loss": fmt_loss(summary["last_loss"], summary["last_loss_nonfinite"]),
        "scale": fmt_number(summary["loss_scale"]),
        "overflows": str(summary["overflow_count"]),
    }


def _progress(ui: Ui) -> Progress:
    return Progress(
        TextColumn("[bold]{task.fields[job]}[/] {task.fields[status]}"),
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TextColumn("epoch {task.fields[epoch]}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("scale {task.fields[scale]}"),
        TextColumn("overflows {task.fields[overflows]}"),
        TimeElapsedColumn(),
        console=ui.out,
    )


def _changes(old: Job, new: Job) -> list[str]:
    """Lines worth printing above the bar when a polled job changes."""
    lines = []
    if len(new["attempt_errors"]) > len(old["attempt_errors"]) and new["status"] not in FINISHED:
        # A retry; the final attempt's error comes with the outcome instead.
        last = new["attempt_errors"][-1]
        lines.append(f"attempt {last.get('attempt')} failed: {last.get('error')}; retrying")
    if new["attempt"] != old["attempt"] and new["status"] == "running":
        lines.append(
            f"job {new['id']} running on {new['worker_id']} "
            f"(attempt {new['attempt']} of {new['max_attempts']})"
        )
    if new["cancel_requested"] and not old["cancel_requested"]:
        lines.append("cancel requested")
    warning = new["summary"].get("guard_warning")
    if warning and warning != old["summary"].get("guard_warning"):
        lines.append(f"warning: {warning}")
    return lines


def _poll_patiently(
    client: HalfwayClient, job_id: int, etag: str | None, console: Console
) -> tuple[Job | None, str | None]:
    deadline = time.monotonic() + WATCH_PATIENCE_SECONDS
    warned = False
    while True:
        try:
            return client.job(job_id, etag)
        except CliError as exc:
            if exc.code not in TRANSIENT or time.monotonic() > deadline:
                raise
            if not warned:
                console.print(
                    f"[yellow]{escape(exc.message)}; retrying for up to "
                    f"{WATCH_PATIENCE_SECONDS:.0f} s[/]"
                )
                warned = True
            time.sleep(POLL_SECONDS)


def watch_job(client: HalfwayClient, job: Job, ui: Ui) -> Job:
    """Draw the job until it finishes, polling about every ``POLL_SECONDS``; an unchanged job
    costs an empty 304 thanks to its ETag."""
    etag: str | None = None
    with _progress(ui) as progress:
        task = progress.add_task("", total=None, **_bar_fields(job))
        while True:
            fresh, etag = _poll_patiently(client, job["id"], etag, progress.console)
            if fresh is not None:
                for line in _changes(job, fresh):
                    progress.console.print(escape(line))
                job = fresh
                done = job["progress"]["step"] or 0
                progress.update(
                    task, completed=done, total=job["progress"]["total_steps"], **_bar_fields(job)
                )
            if job["status"] in FINISHED:
                return job
            time.sleep(POLL_SECONDS)


def report_outcome(ui: Ui, job: Job) -> ExitCode:
    summary, took = job["summary"], fmt_duration(job)
    ident = f"job {job['id']}"
    if job["status"] == "succeeded":
        ui.out.print(
            f"[bold green]{ident} succeeded[/]{f' in {took}' if took else ''}: "
            f"{fmt_number(job['progress']['step'])} steps, last loss "
            f"{fmt_loss(summary['last_loss'], summary['last_loss_nonfinite'])}, loss scale "
            f"{fmt_number(summary['loss_scale'])}, {summary['overflow_count']} overflow(s)"
        )
        return ExitCode.OK
    if job["status"] == "cancelled":
        done = fmt_number(job["progress"]["step"])
        ui.out.print(f"[bold yellow]{ident} cancelled[/] after {done} step(s)")
        return ExitCode.JOB_CANCELLED
    ui.out.print(f"[bold red]{ident} failed:[/] {escape(job.get('error') or 'no error recorded')}")
    errors = job.get("attempt_errors", [])
    if len(errors) > 1:
        for entry in errors:
            ui.out.print(f"  attempt {entry.get('attempt')}: {escape(str(entry.get('error')))}")
    ui.out.print(f"[dim]The training log: halfway logs {job['id']}[/]")
    return ExitCode.JOB_FAILED


# --------------------------------------------------------------------------------------------
# jobs and show


def jobs_table(page: dict[str, Any]) -> Table:
    table = Table(title="Jobs (newest first)", title_justify="left")
    for name, justify in (
        ("id", "right"),
        ("name", "left"),
        ("owner", "left"),
        ("status", "left"),
        ("progress", "right"),
        ("loss scale", "right"),
        ("overflows", "right"),
        ("created", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=name != "name")  # type: ignore[arg-type]
    for job in page["items"]:
        summary = job["summary"]
        table.add_row(
            str(job["id"]),
            Text(job["name"]),
            Text(job["owner"]),
            styled_status(job["status"]),
            fmt_progress(job["progress"]),
            fmt_number(summary["loss_scale"]),
            Text(str(summary["overflow_count"]), style="red" if summary["overflow_count"] else ""),
            fmt_time(job["created_at"]),
        )
    return table


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    return grid


def _model_line(model: Mapping[str, Any]) -> str:
    if model.get("kind", "mlp") == "mlp":
        layers = [model.get("input_size"), *model.get("hidden", []), model.get("num_classes")]
        return f"mlp {' -> '.join(str(n) for n in layers)} ({model.get('activation', 'relu')})"
    scalars = ", ".join(f"{k}={v}" for k, v in model.items() if k != "kind" and _scalar(v))
    return f"{model.get('kind')} ({scalars})"


def _scalar(value: Any) -> bool:
    return isinstance(value, str | int | float | bool)


def _data_line(data: Mapping[str, Any]) -> str:
    kind = data.get("kind", "synthetic")
    if kind == "synthetic":
        return (
            f"synthetic, {data.get('samples')} samples x {data.get('features')} features, "
            f"{data.get('classes')} classes"
        )
    return f"{kind} {data.get('path') or data.get('name')}"


def _loss_scale_line(ls: Mapping[str, Any]) -> str:
    mode = ls.get("mode", "auto")
    if mode == "dynamic":
        return (
            f"dynamic from {fmt_number(ls.get('initial_scale'))}: x{ls.get('growth_factor')} "
            f"after {ls.get('growth_steps')} finite steps, x{ls.get('backoff_factor')} on "
            f"overflow, within [{fmt_number(ls.get('min_scale'))}, "
            f"{fmt_number(ls.get('max_scale'))}]"
        )
    if mode == "fixed":
        return f"fixed at {fmt_number(ls.get('initial_scale'))}"
    return str(mode)


def spec_lines(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    training, optimizer = spec.get("training", {}), spec.get("optimizer", {})
    outputs = spec.get("outputs", {})
    lines = [
        ("policy", str(spec.get("precision", {}).get("policy", "mixed_float16"))),
        ("loss scaling", _loss_scale_line(spec.get("loss_scale", {}))),
        ("model", _model_line(spec.get("model", {}))),
        ("data", _data_line(spec.get("data", {}))),
        ("optimizer", f"{optimizer.get('name')}, learning rate {optimizer.get('learning_rate')}"),
        (
            "training",
            f"{training.get('epochs')} epoch(s), batch size {training.get('batch_size')}",
        ),
        (
            "outputs",
            f"model {'saved' if outputs.get('save_model', True) else 'not saved'}, "
            f"tensorboard {'on' if outputs.get('tensorboard') else 'off'}",
        ),
    ]
    faults = {k: v for k, v in spec.get("faults", {}).items() if v not in (None, [])}
    if faults:
        lines.append(("faults", json.dumps(faults)))
    return lines


def job_details(job: Job) -> Table:
    summary, grid = job["summary"], _grid()
    grid.add_row("job", Text.assemble((f"{job['id']} ", "bold"), job["name"]))
    grid.add_row("status", styled_status(job["status"]))
    if job.get("error"):
        grid.add_row("error", Text(job["error"], style="red"))
    grid.add_row("owner", Text(job["owner"]))
    grid.add_row("priority", str(job["priority"]))
    attempt = f"{job['attempt']} of {job['max_attempts']}"
    if job.get("worker_id"):
        attempt += f" (worker {job['worker_id']})"
    grid.add_row("attempt", Text(attempt))
    for entry in job.get("attempt_errors", []):
        grid.add_row(
            f"attempt {entry.get('attempt')}",
            Text(f"{entry.get('error')} ({fmt_time(entry.get('at'))})", style="red"),
        )
    grid.add_row("created", fmt_time(job["created_at"]))
    grid.add_row("started", fmt_time(job.get("started_at")))
    finished = fmt_time(job.get("finished_at"))
    took = fmt_duration(job)
    grid.add_row("finished", f"{finished} (took {took})" if took else finished)
    grid.add_row("progress", f"{fmt_progress(job['progress'])}, epoch {fmt_epoch(job)}")
    loss = fmt_loss(summary["last_loss"], summary["last_loss_nonfinite"])
    grid.add_row("last loss", f"{loss} (step {fmt_number(summary['last_step'])})")
    grid.add_row(
        "loss scale",
        f"{fmt_number(summary['loss_scale'])} (lowest {fmt_number(summary['min_loss_scale'])}; "
        f"{summary['growth_count']} growth(s), {summary['backoff_count']} back-off(s))",
    )
    grid.add_row(
        "overflows",
        Text(
            f"{summary['overflow_count']} step(s) with non-finite gradients, "
            f"{summary['nonfinite_loss_count']} non-finite loss(es)",
            style="red" if summary["overflow_count"] else "",
        ),
    )
    if summary.get("steps_per_second"):
        grid.add_row("speed", f"{summary['steps_per_second']:.1f} steps/s")
    if summary.get("checkpoint_step") is not None:
        grid.add_row("checkpoint", f"step {summary['checkpoint_step']}")
    if summary.get("guard_warning"):
        grid.add_row("guard", Text(summary["guard_warning"], style="yellow"))
    for key, value in (summary.get("metrics") or {}).items():
        grid.add_row(f"metrics.{key}", Text(json.dumps(value)))
    for warning in job.get("warnings", []):
        grid.add_row("warning", Text(warning, style="yellow"))
    for note in job.get("notes", []):
        grid.add_row("note", Text(note))
    for label, value in spec_lines(job.get("spec", {})):
        grid.add_row(f"spec: {label}", Text(value))
    return grid


# --------------------------------------------------------------------------------------------
# history


def rows_table(job_id: int, page: dict[str, Any]) -> Table:
    table = Table(title=f"Job {job_id} history ({page['status']})", title_justify="left")
    for name in ("step", "epoch", "loss", "loss scale", "finite"):
        table.add_column(name, justify="left" if name == "finite" else "right")
    for row in page["items"]:
        overflow = not row["finite"]
        table.add_row(
            str(row["step"]),
            str(row["epoch"]),
            fmt_loss(row["loss"], row["loss_nonfinite"]),
            fmt_number(row["loss_scale"]),
            Text("OVERFLOW (update skipped)", style="bold red") if overflow else "yes",
            style="red" if overflow else None,
        )
    return table


def buckets_table(page: dict[str, Any]) -> Table:
    title = (
        f"Job {page['job_id']} history, steps {page['from_step']}-{page['to_step']} in buckets "
        f"of {page['width']} step(s) ({page['status']}); ! marks buckets with overflows"
    )
    table = Table(title=title, title_justify="left")
    for name in (
        "!",
        "steps",
        "count",
        "loss min",
        "loss max",
        "loss last",
        "scale min",
        "scale max",
        "scale last",
        "overflows",
        "non-finite losses",
    ):
        table.add_column(name, justify="left" if name in ("!", "steps") else "right")
    for b in page["buckets"]:
        overflow = b["overflow_count"] > 0
        table.add_row(
            Text("!", style="bold red") if overflow else "",
            f"{b['first_step']}-{b['last_step']}",
            str(b["count"]),
            fmt_number(b["loss_min"]),
            fmt_number(b["loss_max"]),
            fmt_loss(b["loss_last"], b["loss_last_nonfinite"]),
            fmt_number(b["scale_min"]),
            fmt_number(b["scale_max"]),
            fmt_number(b["scale_last"]),
            str(b["overflow_count"]),
            str(b["nonfinite_loss_count"]),
            style="red" if overflow else None,
        )
    return table


def stream_csv(client: HalfwayClient, job_id: int) -> None:
    out = binary_stdout()
    with client.stream(f"/v1/jobs/{job_id}/history.csv") as response:
        for chunk in response.iter_bytes():
            out.write(chunk)
    out.flush()


def download(client: HalfwayClient, path: str, file: Path) -> int:
    """Stream ``path`` into ``file``; the bytes written. The download goes to a temporary file
    beside it, renamed at the end, so a failed one never leaves half a file under the name."""
    partial = file.with_name(f".{file.name}.partial")
    written = 0
    try:
        with client.stream(path) as response, partial.open("wb") as out:
            for chunk in response.iter_bytes():
                out.write(chunk)
                written += len(chunk)
        partial.replace(file)
    except OSError as exc:
        raise CliError(f"cannot write {file}: {exc.strerror or exc}", ExitCode.USAGE) from None
    finally:
        partial.unlink(missing_ok=True)
    return written


# --------------------------------------------------------------------------------------------
# logs


def follow_log(client: HalfwayClient, job_id: int, offset: int, out: BinaryIO) -> str:
    """Print new log bytes as they come; stop once the job has finished and no more come.
    The log is complete before the job's status is final (the child writes it, and the
    supervisor ends the job after the child exits), so one more read after that suffices."""
    etag: str | None = None
    status = ""
    while True:
        data, offset = client.logs(job_id, offset)
        if data:
            write_bytes(out, data)
            continue
        if status in FINISHED:
            return status
        job, etag = client.job(job_id, etag)
        if job is not None:
            status = job["status"]
        if status not in FINISHED:
            time.sleep(POLL_SECONDS)


# --------------------------------------------------------------------------------------------
# tensorboard


def server_artifact_dir(flag: str | None, env: Mapping[str, str]) -> str:
    """Our best knowledge of the server's HALFWAY_ARTIFACT_DIR (the API does not say)."""
    if flag:
        return flag
    if env.get("HALFWAY_ARTIFACT_DIR"):
        return env["HALFWAY_ARTIFACT_DIR"]
    home = env.get("HALFWAY_HOME") or ".halfway"
    return f"{home.rstrip('/')}/artifacts"


def print_tensorboard(
    ui: Ui, job: Job, artifacts: list[dict[str, Any]], artifact_dir: str, url: str
) -> None:
    logdir = f"{artifact_dir.rstrip('/')}/{job['id']}/tensorboard"
    enabled = bool(job.get("spec", {}).get("outputs", {}).get("tensorboard"))
    ui.out.print(
        f"TensorBoard for job [bold]{job['id']}[/] ({escape(job['name'])}, {job['status']})"
    )
    ui.out.print(
        "Its event files are on the server host, in the job's artifact directory:\n"
        f"    {escape(logdir)}\n"
        "[dim](the server's HALFWAY_ARTIFACT_DIR, by default .halfway/artifacts under the "
        "directory `halfway serve` runs in; use --artifact-dir if yours differs)[/]"
    )
    ui.out.print("On the server host, run:")
    ui.out.print(f"    tensorboard --logdir {escape(shlex.quote(logdir))}", soft_wrap=True)
    host = urlsplit(url).hostname or "localhost"
    if host not in ("localhost", "127.0.0.1", "::1"):
        ui.out.print(
            "From your machine, tunnel its port, then open http://localhost:6006:\n"
            f"    ssh -N -L 6006:localhost:6006 {escape(host)}",
            soft_wrap=True,
        )
    if artifacts:
        listed = ", ".join(f"{a['name']} ({a['bytes']} bytes)" for a in artifacts)
        ui.out.print(f"Artifacts the server lists for this job: {escape(listed)}")
    if enabled:
        ui.out.print("outputs.tensorboard is on for this job.")
        return
    ui.out.print(
        f"[yellow]Job {job['id']} did not enable TensorBoard[/] (outputs.tensorboard is off), "
        "so it writes no event files. Resubmit with, in YAML:\n"
        "    outputs:\n"
        "      tensorboard: true\n"
        'or in JSON: "outputs": {"tensorboard": true}'
    )


# --------------------------------------------------------------------------------------------
# The commands

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help=f"Server URL. Else HALFWAY_URL, the config file, {DEFAULT_URL}.",
        show_default=False,
        rich_help_panel="Connection",
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="API token. Else HALFWAY_TOKEN, the config file. (A flag shows in `ps`; "
        "prefer the environment or the config file.)",
        show_default=False,
        rich_help_panel="Connection",
    ),
]
JobId = Annotated[
    int, typer.Argument(metavar="ID", help="The job's id.", min=1, show_default=False)
]


class StatusFilter(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


@handles_errors
def submit(
    spec_file: Annotated[
        str,
        typer.Argument(
            metavar="SPEC.yaml|SPEC.json",
            help="The job spec, YAML or JSON; '-' reads it from stdin.",
            show_default=False,
        ),
    ],
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Show live progress until the job ends.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate and normalize; store nothing.")
    ] = False,
    idempotency_key: Annotated[
        str | None,
        typer.Option(
            "--idempotency-key",
            help="Submitting again with the same key returns the first job (a safe retry).",
            show_default=False,
        ),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Submit a job. With --watch, follow it to its end: exit 0 only if it succeeded."""
    if watch and dry_run:
        raise CliError(
            "--watch and --dry-run exclude each other: a dry run starts no job", ExitCode.USAGE
        )
    spec = load_spec(spec_file)
    ui = Ui.create()
    with connect(url, token) as client:
        if dry_run:
            result, _ = client.submit(spec, dry_run=True)
            print_dry_run(ui, result)
            return
        job, replayed = client.submit(spec, key=idempotency_key)
        print_submitted(ui, job, replayed, idempotency_key)
        if not watch:
            ui.out.print(f"[dim]Follow it: halfway submit --watch, or halfway show {job['id']}[/]")
            return
        final = watch_job(client, job, ui)
    raise typer.Exit(report_outcome(ui, final))


@handles_errors
def jobs(
    status: Annotated[
        StatusFilter | None, typer.Option(help="Only jobs in this status.", show_default=False)
    ] = None,
    owner: Annotated[str | None, typer.Option(help="Only this user's jobs.")] = None,
    limit: Annotated[int, typer.Option(help="How many (newest first).", min=1, max=200)] = 20,
    cursor: Annotated[
        str | None, typer.Option(help="Older jobs: the cursor a previous page printed.")
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """List jobs, newest first."""
    params: dict[str, str | int] = {"limit": limit}
    for key, value in (("status", status), ("owner", owner), ("cursor", cursor)):
        if value is not None:
            params[key] = str(value)
    ui = Ui.create()
    with connect(url, token) as client:
        page = client.jobs(params)
    if not page["items"]:
        ui.out.print("No jobs.")
        return
    ui.out.print(jobs_table(page))
    if page.get("next_cursor"):
        ui.out.print(f"[dim]Older jobs: halfway jobs --cursor {page['next_cursor']}[/]")


@handles_errors
def show(
    job_id: JobId,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Show a job: status, errors, warnings, notes, summary, progress and its spec."""
    with connect(url, token) as client:
        job, _ = client.job(job_id)
    assert job is not None  # no ETag sent, so never a 304
    if as_json:
        typer.echo(json.dumps(job, indent=2))
        return
    Ui.create().out.print(job_details(job))


@handles_errors
def history(
    job_id: JobId,
    as_csv: Annotated[
        bool, typer.Option("--csv", help="Every row as CSV (streamed) to stdout.")
    ] = False,
    arrow: Annotated[
        Path | None,
        typer.Option(
            "--arrow", help="Write every row to this file as an Arrow IPC stream.", dir_okay=False
        ),
    ] = None,
    parquet: Annotated[
        Path | None,
        typer.Option("--parquet", help="Write every row to this Parquet file.", dir_okay=False),
    ] = None,
    points: Annotated[
        int | None,
        typer.Option(
            help="Summarize in at most P buckets (min/max/last loss and scale, overflows).",
            min=1,
            max=5000,
            show_default=False,
        ),
    ] = None,
    after_step: Annotated[
        int | None,
        typer.Option(help="Rows after this step (default: from the start).", min=-1),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(help="Rows to print (default 50).", min=1, max=10_000),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """A job's per-step history: loss, loss scale and overflows."""
    chosen = [
        name
        for name, given in (
            ("--csv", as_csv),
            ("--points", points is not None),
            ("--arrow", arrow is not None),
            ("--parquet", parquet is not None),
        )
        if given
    ]
    if len(chosen) > 1:
        raise CliError(f"choose one of {' and '.join(chosen)}", ExitCode.USAGE)
    if chosen and (after_step is not None or limit is not None):
        raise CliError(
            f"--after-step and --limit page raw rows; not with {chosen[0]}", ExitCode.USAGE
        )
    ui = Ui.create()
    with connect(url, token) as client:
        if as_csv:
            stream_csv(client, job_id)
            return
        for file, suffix in ((arrow, "arrow"), (parquet, "parquet")):
            if file is not None:
                size = download(client, f"/v1/jobs/{job_id}/history.{suffix}", file)
                ui.out.print(
                    f"Wrote job {job_id}'s history to {escape(str(file))} ({size:,} bytes)."
                )
                return
        if points is not None:
            page = client.history(job_id, {"points": points})
            if not page["buckets"]:
                ui.out.print(f"Job {job_id} has no history yet ({page['status']}).")
                return
            ui.out.print(buckets_table(page))
            return
        after = -1 if after_step is None else after_step
        page = client.history(job_id, {"after_step": after, "limit": limit or 50})
    if not page["items"]:
        ui.out.print(f"Job {job_id} has no history after step {after} ({page['status']}).")
        return
    ui.out.print(rows_table(job_id, page))
    if page["has_more"]:
        ui.out.print(
            f"[dim]More: halfway history {job_id} --after-step {page['next_after_step']}[/]"
        )


@handles_errors
def cancel(job_id: JobId, url: UrlOption = None, token: TokenOption = None) -> None:
    """Cancel a job (yours, or any job as an admin)."""
    with connect(url, token) as client:
        job = client.cancel(job_id)
    out = Ui.create().out
    if job["status"] == "cancelled":
        out.print(f"Job {job_id} cancelled.")
    else:
        out.print(
            f"Cancel requested: job {job_id} is {job['status']}; its worker stops it after the "
            "current step and keeps the steps so far."
        )


@handles_errors
def logs(
    job_id: JobId,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Keep printing new lines until the job ends."),
    ] = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Print a job's training log (its last 64 KiB), and with --follow what comes next."""
    out = binary_stdout()
    ui = Ui.create()
    with connect(url, token) as client:
        data, offset = client.logs(job_id, None)
        write_bytes(out, data)
        if not follow:
            if not data:
                ui.err.print(f"[dim]Job {job_id} has no log yet.[/]")
            return
        status = follow_log(client, job_id, offset, out)
    ui.err.print(f"[dim]Job {job_id} {status}.[/]")


@handles_errors
def tensorboard(
    job_id: JobId,
    artifact_dir: Annotated[
        str | None,
        typer.Option(
            help="The server's artifact directory, if not HALFWAY_ARTIFACT_DIR or "
            "HALFWAY_HOME/artifacts (.halfway/artifacts).",
            show_default=False,
        ),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Print how to open TensorBoard on a job's event files."""
    with connect(url, token) as client:
        job, _ = client.job(job_id)
        artifacts = client.artifacts(job_id)
    assert job is not None
    directory = server_artifact_dir(artifact_dir, os.environ)
    print_tensorboard(Ui.create(), job, artifacts, directory, client.target.url)


def sweep_table(sweep: Mapping[str, Any]) -> Table:
    """The side-by-side comparison: speed, convergence and loss-scale behaviour per variant."""
    table = Table(title=f"sweep {sweep['id']}: {escape(sweep['name'])}", header_style="bold")
    for column in (
        "variant",
        "status",
        "examples/s",
        "step ms",
        "vs float32",
        "to target",
        "final loss",
        "val",
        "overflows",
        "skipped",
        "scale (final/min)",
        "peak mem",
    ):
        table.add_column(
            column, justify="left" if column in ("variant", "status", "val") else "right"
        )
    for v in sweep["variants"]:
        metrics = v["final_metrics"]
        val = ", ".join(
            f"{k} {fmt_number(x, 4)}" for k, x in metrics.items() if k.startswith("val_")
        )
        target = (
            f"{v['time_to_target_seconds']:.1f} s (step {v['step_to_target']})"
            if v["time_to_target_seconds"] is not None
            else "-"
        )
        step_ms = v["median_step_seconds"]
        scale = (
            f"{fmt_number(v['final_loss_scale'])} / {fmt_number(v['min_loss_scale'])}"
            if v["final_loss_scale"] is not None
            else "-"
        )
        memory = v["peak_memory_bytes"]
        table.add_row(
            escape(v["name"]),
            styled_status(v["status"]),
            fmt_number(v["examples_per_second"], 6),
            f"{step_ms * 1000:.2f}" if step_ms is not None else "-",
            f"{v['speedup_vs_float32']:.2f}x" if v["speedup_vs_float32"] is not None else "-",
            target,
            fmt_number(v["final_loss"]),
            escape(val) or "-",
            str(v["overflow_count"]),
            str(v["skipped_steps"]),
            scale,
            f"{memory / 2**20:.0f} MiB" if memory is not None else "-",
        )
    return table


@handles_errors
def sweep(
    spec_file: Annotated[
        str,
        typer.Argument(
            metavar="SPEC.yaml|SPEC.json",
            help="A job spec (the base), or a sweep spec with 'base' and 'variants'.",
            show_default=False,
        ),
    ],
    policies: Annotated[
        str | None,
        typer.Option(help="Comma-separated policies, one variant each.", show_default=False),
    ] = None,
    target_loss: Annotated[
        float | None,
        typer.Option(help="Measure each variant's time to this loss.", show_default=False),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Wait for every variant and print the table.")
    ] = True,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Run one job per precision variant of a spec and compare them side by side."""
    spec = load_spec(spec_file)
    body: dict[str, Any] = dict(spec) if "base" in spec or "variants" in spec else {"base": spec}
    if policies:
        body["policies"] = [p.strip() for p in policies.split(",") if p.strip()]
    if target_loss is not None:
        body["target_loss"] = target_loss
    ui = Ui.create()
    with connect(url, token) as client:
        created = client.create_sweep(body)
        ids = ", ".join(str(v["job_id"]) for v in created["variants"])
        ui.out.print(f"sweep {created['id']}: {len(created['variants'])} jobs ({ids})")
        table = created
        while wait and not table["done"]:
            time.sleep(2.0)
            table = client.sweep(created["id"])
    ui.out.print(sweep_table(table))
    if wait and any(v["status"] != "succeeded" for v in table["variants"]):
        raise typer.Exit(ExitCode.JOB_FAILED)


COMMANDS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("submit", submit),
    ("jobs", jobs),
    ("show", show),
    ("history", history),
    ("cancel", cancel),
    ("logs", logs),
    ("tensorboard", tensorboard),
    ("sweep", sweep),
)


def register(app: typer.Typer) -> None:
    """Add the client commands to ``app`` (once, however often this is called)."""
    present = {info.callback for info in app.registered_commands}
    for name, command in COMMANDS:
        if command not in present:
            app.command(name, rich_help_panel=PANEL)(command)
