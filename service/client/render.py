"""How the ``halfway`` commands talk to a person: formatting, one-line messages, the progress
bar, a watched job's outcome. Tables are in ``service.client.tables``. Nothing here talks
HTTP; the commands pass in what the ``Client`` returned."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from service.client.api import Job
from service.client.errors import ExitCode
from service.vocabulary import FINISHED_STATUSES

# Rich folds tables to 80 columns when stdout is not a terminal; a piped table stays whole.
PIPE_WIDTH = 160


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


def bar_fields(job: Job) -> dict[str, Any]:
    summary = job["summary"]
    return {
        "job": f"job {job['id']}",
        "status": f"[{STATUS_STYLE.get(job['status'], '')}]{job['status']}[/]",
        "epoch": fmt_epoch(job),
        "loss": fmt_loss(summary["last_loss"], summary["last_loss_nonfinite"]),
        "scale": fmt_number(summary["loss_scale"]),
        "overflows": str(summary["overflow_count"]),
    }


def progress_bar(ui: Ui) -> Progress:
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


def sweep_bars(ui: Ui) -> Progress:
    """One bar per variant of a sweep: its status, steps, last loss, scale and overflows."""
    return Progress(
        TextColumn("[bold]{task.fields[variant]}[/] {task.fields[status]}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("scale {task.fields[scale]}"),
        TextColumn("overflows {task.fields[overflows]}"),
        TimeElapsedColumn(),
        console=ui.out,
    )


def variant_fields(name: str, job: Job | None) -> dict[str, Any]:
    """A variant's bar before its job is read (queued, nothing yet), then the job's."""
    if job is None:
        return {
            "variant": escape(name),
            "status": "[blue]queued[/]",
            **dict.fromkeys(("loss", "scale", "overflows"), "-"),
        }
    fields = bar_fields(job)
    return {
        "variant": escape(name),
        **{key: fields[key] for key in ("status", "loss", "scale", "overflows")},
    }


def variant_changes(name: str, old: Job | None, new: Job) -> list[str]:
    """Lines worth printing above a sweep's bars when a variant's job changes (or is first
    read), each led by the variant's name; its outcome once it has finished."""
    if old is None:
        lines = []
        if new["status"] == "running":
            lines.append(
                f"job {new['id']} running on {new['worker_id']} "
                f"(attempt {new['attempt']} of {new['max_attempts']})"
            )
    else:
        lines = changes(old, new)
    if new["status"] in FINISHED_STATUSES and (old is None or old["status"] != new["status"]):
        lines.append(outcome(new))
    return [f"{name}: {line}" for line in lines]


def outcome(job: Job) -> str:
    """A finished job in one line of plain text."""
    summary, took = job["summary"], fmt_duration(job)
    if job["status"] == "succeeded":
        return (
            f"succeeded{f' in {took}' if took else ''}: "
            f"{fmt_number(job['progress']['step'])} steps, last loss "
            f"{fmt_loss(summary['last_loss'], summary['last_loss_nonfinite'])}, loss scale "
            f"{fmt_number(summary['loss_scale'])}, {summary['overflow_count']} overflow(s)"
        )
    if job["status"] == "cancelled":
        return f"cancelled after {fmt_number(job['progress']['step'])} step(s)"
    return f"failed: {job.get('error') or 'no error recorded'} (its log: halfway logs {job['id']})"


def changes(old: Job, new: Job) -> list[str]:
    """Lines worth printing above the bar when a polled job changes."""
    lines = []
    retried = new["attempt_errors"][len(old["attempt_errors"]) :]
    if new["status"] == "failed":
        retried = retried[:-1]  # the final attempt's error comes with the outcome instead
    # Every retry is said, also one that a poll found already behind a finished job.
    for entry in retried:
        lines.append(f"attempt {entry.get('attempt')} failed: {entry.get('error')}; retrying")
    if new["attempt"] != old["attempt"] and new["status"] == "running":
        lines.append(
            f"job {new['id']} running on {new['worker_id']} "
            f"(attempt {new['attempt']} of {new['max_attempts']})"
        )
    if new.get("history_version", 0) > old.get("history_version", 0):
        # A resume replaced the steps from its checkpoint on; the bar goes back there.
        lines.append(
            f"attempt {new['attempt']} resumed from its checkpoint: history from step "
            f"{new.get('history_reset_step') or 0} on is being trained again"
        )
    if new["cancel_requested"] and not old["cancel_requested"]:
        lines.append("cancel requested")
    warning = new["summary"].get("guard_warning")
    if warning and warning != old["summary"].get("guard_warning"):
        lines.append(f"warning: {warning}")
    return lines


def print_rewrite(ui: Ui, page: Mapping[str, Any]) -> None:
    """A page after a resume: whoever pages by hand should know that rows read before may be
    the replaced ones (the version tells; see the API's history_version)."""
    version = page.get("history_version") or 0
    if version > 0:
        ui.out.print(
            f"[dim]History version {version}: a resume trained the steps from "
            f"{page.get('history_reset_step') or 0} on again; pages read before version "
            f"{version} hold the replaced rows from there.[/]"
        )


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


def server_artifact_dir(flag: str | None, env: Mapping[str, str]) -> str:
    """Our best knowledge of the server's HALFWAY_ARTIFACT_DIR (the API does not say)."""
    if flag:
        return flag
    store = env.get("HALFWAY_STORAGE_URL") or ""
    if store.startswith("s3://"):
        return f"{store.rstrip('/')}/artifacts"  # TensorBoard reads s3:// itself (boto3)
    if store.startswith("file://"):
        return f"{urlsplit(store).path.rstrip('/')}/artifacts"
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
