"""The ``halfway`` client commands: submit jobs and watch them, list and inspect jobs, read their
history and logs, cancel them, find their TensorBoard files, run precision sweeps. They are
built on ``service.client.Client`` (the only code here that talks HTTP) and print with
``service.client.render``; ``register(app)`` adds them to the ``halfway`` command.

Commands (each also takes ``--url`` and ``--token``, resolved as ``service.client.config``
says)::

    halfway submit SPEC.yaml|SPEC.json|- [--watch] [--dry-run] [--idempotency-key K]
    halfway jobs [--status S] [--owner O] [--limit N] [--cursor C]
    halfway show ID [--json]
    halfway history ID [--after-step N] [--limit N] | --csv | --points P | --arrow F | --parquet F
    halfway gradients ID [--after-step N] [--limit N] [--variables] [--step N]
    halfway cancel ID
    halfway logs ID [--follow]
    halfway tensorboard ID [--artifact-dir DIR]
    halfway sweep SPEC [--policies float32,mixed_float16,mixed_bfloat16] [--target-loss L]

Exit codes are ``service.client.errors.ExitCode``:

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
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from service.client import render, tables
from service.client.api import Client, with_bundle
from service.client.code_commands import code_app, push
from service.client.errors import ExitCode, UsageError
from service.client.gradient_commands import gradients
from service.client.gradient_tables import decision_table
from service.client.options import JobId, TokenOption, UrlOption, handles_errors
from service.client.render import Ui
from service.client.specfile import load_spec
from service.client.watching import follow_log, watch_job, watch_sweep
from service.vocabulary import JOB_STATUSES

PANEL = "Client (talk to a running server)"


@contextlib.contextmanager
def connect(url: str | None, token: str | None) -> Iterator[Client]:
    with Client(url, token) as client:
        yield client


def stream_csv(client: Client, job_id: int) -> None:
    out = render.binary_stdout()
    with client.history_csv(job_id) as chunks:
        for chunk in chunks:
            out.write(chunk)
    out.flush()


StatusFilter = StrEnum("StatusFilter", {status: status for status in JOB_STATUSES})  # type: ignore[misc]


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
    code: Annotated[
        str | None,
        typer.Option(
            "--code",
            metavar="DIR",
            help="Pack DIR (skipping .git, __pycache__, virtualenvs, .halfwayignore), upload "
            "it and fill code.bundle.",
            show_default=False,
        ),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Submit a job. With --watch, follow it to its end: exit 0 only if it succeeded."""
    if watch and dry_run:
        raise UsageError("--watch and --dry-run exclude each other: a dry run starts no job")
    spec = load_spec(spec_file)
    ui = Ui.create()
    with connect(url, token) as client:
        if code is not None:
            spec = with_bundle(spec, push(client, code, ui))
        if dry_run:
            result = client.submit(spec, dry_run=True)
            render.print_dry_run(ui, result)
            return
        job, replayed = client.post_job(spec, idempotency_key=idempotency_key)
        render.print_submitted(ui, job, replayed, idempotency_key)
        if not watch:
            ui.out.print(f"[dim]Follow it: halfway submit --watch, or halfway show {job['id']}[/]")
            return
        final = watch_job(client, job, ui)
    raise typer.Exit(render.report_outcome(ui, final))


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
    ui = Ui.create()
    with connect(url, token) as client:
        page = client.jobs(
            status=None if status is None else str(status), owner=owner, limit=limit, cursor=cursor
        )
    if not page["items"]:
        ui.out.print("No jobs.")
        return
    ui.out.print(tables.jobs_table(page))
    if page.get("next_cursor"):
        ui.out.print(f"[dim]Older jobs: halfway jobs --cursor {page['next_cursor']}[/]")


@handles_errors
def show(
    job_id: JobId,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Show a job: status, errors, warnings, notes, summary, progress, its latest gradient
    figures, the precision it chose (with its probes) and its spec."""
    with connect(url, token) as client:
        job = client.job(job_id)
    if as_json:
        typer.echo(json.dumps(job, indent=2))
        return
    out = Ui.create().out
    out.print(tables.job_details(job))
    if job.get("precision_decision"):
        out.print(decision_table(job["precision_decision"]))


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
        raise UsageError(f"choose one of {' and '.join(chosen)}")
    if chosen and (after_step is not None or limit is not None):
        raise UsageError(f"--after-step and --limit page raw rows; not with {chosen[0]}")
    ui = Ui.create()
    with connect(url, token) as client:
        if as_csv:
            stream_csv(client, job_id)
            return
        for file, fmt in ((arrow, "arrow"), (parquet, "parquet")):
            if file is not None:
                size = client.download_history(job_id, fmt, file)
                ui.out.print(
                    f"Wrote job {job_id}'s history to {escape(str(file))} ({size:,} bytes)."
                )
                return
        if points is not None:
            page = client.buckets(job_id, points)
            if not page["buckets"]:
                ui.out.print(f"Job {job_id} has no history yet ({page['status']}).")
                return
            ui.out.print(tables.buckets_table(page))
            render.print_rewrite(ui, page)
            return
        after = -1 if after_step is None else after_step
        page = client.history_page(job_id, after_step=after, limit=limit or 50)
    if not page["items"]:
        ui.out.print(f"Job {job_id} has no history after step {after} ({page['status']}).")
        return
    ui.out.print(tables.rows_table(job_id, page))
    render.print_rewrite(ui, page)
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
    out = render.binary_stdout()
    ui = Ui.create()
    with connect(url, token) as client:
        data, offset = client.logs(job_id, None)
        render.write_bytes(out, data)
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
        job = client.job(job_id)
        artifacts = client.artifacts(job_id)
    directory = render.server_artifact_dir(artifact_dir, os.environ)
    render.print_tensorboard(Ui.create(), job, artifacts, directory, client.url)


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
    code: Annotated[
        str | None,
        typer.Option(
            "--code",
            metavar="DIR",
            help="Pack and upload DIR; fill the base's code.bundle.",
            show_default=False,
        ),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Run one job per precision variant of a spec and compare them side by side; while they
    run, a bar per variant shows its status, steps and loss."""
    spec = load_spec(spec_file)
    chosen = [p.strip() for p in policies.split(",") if p.strip()] if policies else None
    ui = Ui.create()
    with connect(url, token) as client:
        if code is not None:
            digest = push(client, code, ui)
            if "base" in spec or "variants" in spec:
                spec = {**spec, "base": with_bundle(spec.get("base", {}), digest)}
            else:
                spec = with_bundle(spec, digest)
        created = client.start_sweep(spec, policies=chosen, target_loss=target_loss)
        ids = ", ".join(str(v["job_id"]) for v in created["variants"])
        ui.out.print(f"sweep {created['id']}: {len(created['variants'])} jobs ({ids})")
        table = watch_sweep(client, created, ui) if wait else created
    ui.out.print(tables.sweep_table(table, ui.out.width))
    if wait and any(v["status"] != "succeeded" for v in table["variants"]):
        raise typer.Exit(ExitCode.JOB_FAILED)


COMMANDS: tuple[tuple[str, Callable[..., None]], ...] = (
    ("submit", submit),
    ("jobs", jobs),
    ("show", show),
    ("history", history),
    ("gradients", gradients),
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
    if all(group.typer_instance is not code_app for group in app.registered_groups):
        app.add_typer(code_app, name="code", rich_help_panel=PANEL)
