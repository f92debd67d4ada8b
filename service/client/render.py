"""How the ``halfway`` commands show things: rich tables, progress bars and one-line
messages. Nothing here talks HTTP; the commands pass in what the ``Client`` returned."""

from __future__ import annotations

import json
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
from rich.table import Table
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


def changes(old: Job, new: Job) -> list[str]:
    """Lines worth printing above the bar when a polled job changes."""
    lines = []
    if (
        len(new["attempt_errors"]) > len(old["attempt_errors"])
        and new["status"] not in FINISHED_STATUSES
    ):
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


def metric_lines(metrics: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """The summary's metrics as labelled numbers: groups (last_epoch, timing) flattened into
    "last_epoch: accuracy", each number with the unit its name gives."""
    lines: list[tuple[str, str]] = []
    for key, value in metrics.items():
        label = f"{prefix}{key}"
        if isinstance(value, Mapping):
            lines += metric_lines(value, f"{label}: ")
        else:
            lines.append((label, fmt_metric(key, value)))
    return lines


def fmt_metric(key: str, value: Any) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-" if value is None else str(value)
    if key.endswith("_bytes"):
        return f"{value / 2**20:.1f} MiB"
    if key.endswith("_per_second"):
        return f"{fmt_number(value)} /s"
    if key.endswith("_seconds"):
        return f"{fmt_number(value)} s"
    if key == "epoch":
        return str(int(value) + 1)
    return fmt_number(value)


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
    for label, value in metric_lines(summary.get("metrics") or {}):
        grid.add_row(label, value)
    for warning in job.get("warnings", []):
        grid.add_row("warning", Text(warning, style="yellow"))
    for note in job.get("notes", []):
        grid.add_row("note", Text(note))
    for label, value in spec_lines(job.get("spec", {})):
        grid.add_row(f"spec: {label}", Text(value))
    return grid


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


# Dropped first, in this order, when the table does not fit the terminal.
SWEEP_SECONDARY = ("peak mem", "scale (final/min)", "val", "step ms", "skipped")


def sweep_table(sweep: Mapping[str, Any], width: int | None = None) -> Table:
    """The side-by-side comparison: speed, convergence and loss-scale behaviour per variant.
    Within ``width`` columns, secondary columns are dropped (named in the caption) before any
    cell is cut, and each row shows the variant's own name, not the sweep's prefix."""
    rows = [_sweep_cells(sweep, v) for v in sweep["variants"]]
    dropped: list[str] = []
    table = _sweep_grid(sweep, rows, dropped)
    while width is not None and _width(table) > width and len(dropped) < len(SWEEP_SECONDARY):
        dropped.append(SWEEP_SECONDARY[len(dropped)])
        table = _sweep_grid(sweep, rows, dropped)
    return table


def _width(table: Table) -> int:
    console = Console(width=10_000)
    return console.measure(table).maximum


def _sweep_grid(
    sweep: Mapping[str, Any], rows: list[dict[str, Text | str]], dropped: list[str]
) -> Table:
    caption = f"hidden to fit: {', '.join(dropped)} (widen the terminal)" if dropped else None
    table = Table(
        title=f"sweep {sweep['id']}: {escape(sweep['name'])}",
        header_style="bold",
        caption=caption,
    )
    columns = [c for c in rows[0] if c not in dropped] if rows else []
    for column in columns:
        table.add_column(
            column,
            justify="left" if column in ("variant", "status", "val") else "right",
            no_wrap=column != "val",
        )
    for cells in rows:
        table.add_row(*(cells[c] for c in columns))
    return table


def _sweep_cells(sweep: Mapping[str, Any], v: Mapping[str, Any]) -> dict[str, Text | str]:
    metrics = v["final_metrics"]
    val = ", ".join(f"{k} {fmt_number(x, 4)}" for k, x in metrics.items() if k.startswith("val_"))
    target = (
        f"{v['time_to_target_seconds']:.1f} s @{v['step_to_target']}"
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
    # Variant jobs are named "<sweep>/<variant>"; the sweep's name is in the title already.
    name = v["name"].removeprefix(f"{sweep['name']}/")
    return {
        "variant": Text(name),
        "status": styled_status(v["status"]),
        "examples/s": fmt_number(v["examples_per_second"], 6),
        "step ms": f"{step_ms * 1000:.2f}" if step_ms is not None else "-",
        "vs float32": (
            f"{v['speedup_vs_float32']:.2f}x" if v["speedup_vs_float32"] is not None else "-"
        ),
        "to target (step)": target,
        "final loss": fmt_number(v["final_loss"]),
        "val": Text(val or "-"),
        "overflows": str(v["overflow_count"]),
        "skipped": str(v["skipped_steps"]),
        "scale (final/min)": scale,
        "peak mem": f"{memory / 2**20:.0f} MiB" if memory is not None else "-",
    }
