"""The tables the ``halfway`` commands print: jobs, one job's details, history rows and
buckets, a sweep's comparison."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from service.client.api import Job
from service.client.gradient_tables import fmt_share, gradient_rows
from service.client.render import (
    fmt_duration,
    fmt_epoch,
    fmt_loss,
    fmt_number,
    fmt_progress,
    fmt_time,
    styled_status,
)


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
        ("queue", "left"),
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
            fmt_queue(job.get("queue")),
        )
    return table


REASONS = {
    "next": "next to start",
    "priority": "higher-priority jobs ahead",
    "share": "owners further below their share ahead",
    "age": "older jobs ahead",
    "per-user cap": "the owner runs as many jobs as a user may",
    "budget": "the owner has used this window's budget",
    "no slot": "no worker's slot holds the GPUs it needs",
}


def fmt_queue(queue: Mapping[str, Any] | None, *, long: bool = False) -> str:
    """A queued job's place: ``#3 share`` (``long``: with the jobs ahead and the reason in
    words); empty when the job is not queued."""
    if not queue:
        return ""
    place = "held" if queue.get("position") is None else f"#{queue['position']}"
    if not long:
        return f"{place} {queue.get('reason', '')}".strip()
    why = REASONS.get(str(queue.get("reason")), str(queue.get("reason")))
    return f"{place}, {queue.get('ahead', 0)} ahead ({why})"


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


def spec_lines(spec: Mapping[str, Any], *, trained: bool = False) -> list[tuple[str, str]]:
    """The spec, line by line. A code job's function may return its own optimizer, so its
    spec names only the fallback (``trained``: the job has said what it trained with)."""
    training, optimizer = spec.get("training", {}), spec.get("optimizer", {})
    outputs = spec.get("outputs", {})
    optimizer_line = f"{optimizer.get('name')}, learning rate {optimizer.get('learning_rate')}"
    if isinstance(spec.get("code"), dict):
        optimizer_line = (
            "the bundle's, if its function returns one; else "
            f"{optimizer.get('name')} at learning rate {optimizer.get('learning_rate')}"
            + ("" if trained else " (what trained is known once the job starts)")
        )
    lines = [
        ("policy", str(spec.get("precision", {}).get("policy", "mixed_float16"))),
        ("loss scaling", _loss_scale_line(spec.get("loss_scale", {}))),
        *(
            [("code", f"{spec['code'].get('entrypoint')} from {spec['code'].get('bundle')}")]
            if isinstance(spec.get("code"), dict)
            else [
                ("model", _model_line(spec.get("model", {}))),
                ("data", _data_line(spec.get("data", {}))),
            ]
        ),
        ("optimizer", optimizer_line),
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


def trained_lines(job: Job) -> list[tuple[str, str]]:
    """What a code job trained with, as its training child reported it (the job's
    ``device``): the optimizer and its learning rate or schedule, the loss, the batch size."""
    ran = job.get("device") or {}
    report = ran.get("optimizer")
    if not isinstance(job.get("spec", {}).get("code"), dict) or not isinstance(report, Mapping):
        return []
    lines = [("optimizer", f"{fmt_optimizer(report)} (what trained)")]
    if ran.get("loss"):
        lines.append(("loss function", str(ran["loss"])))
    if ran.get("batch_size"):
        lines.append(("batch size", str(ran["batch_size"])))
    return lines


def fmt_optimizer(report: Mapping[str, Any]) -> str:
    """The optimizer a job reported: its class, learning rate or schedule (with arguments)."""
    name = str(report.get("class", "?"))
    schedule = report.get("schedule")
    if isinstance(schedule, Mapping):
        args = ", ".join(
            f"{key}={_fmt_value(value)}" for key, value in schedule.items() if key != "class"
        )
        return f"{name}, learning rate {schedule.get('class')}({args})"
    if report.get("learning_rate") is not None:
        return f"{name}, learning rate {fmt_number(report['learning_rate'])}"
    return name


def _fmt_value(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return fmt_number(value)
    return str(value)


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
    if job.get("queue"):
        grid.add_row("queue", Text(fmt_queue(job["queue"], long=True)))
    attempt = f"{job['attempt']} of {job['max_attempts']}"
    if job.get("worker_id"):
        attempt += f" (worker {job['worker_id']})"
    grid.add_row("attempt", Text(attempt))
    for entry in job.get("attempt_errors", []):
        grid.add_row(
            f"attempt {entry.get('attempt')}",
            Text(f"{entry.get('error')} ({fmt_time(entry.get('at'))})", style="red"),
        )
    for p in job.get("preemptions", []):
        at = "the start" if p.get("step") is None else f"step {p.get('step')}"
        grid.add_row(
            "preempted",
            Text(f"{fmt_time(p.get('at'))} for job {p.get('by_job')} ({p.get('reason')}); at {at}"),
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
    for label, line in gradient_rows(job):
        grid.add_row(label, line)
    for label, value in metric_lines(summary.get("metrics") or {}):
        grid.add_row(label, value)
    for warning in job.get("warnings", []):
        grid.add_row("warning", Text(warning, style="yellow"))
    for note in job.get("notes", []):
        grid.add_row("note", Text(note))
    trained = trained_lines(job)
    for label, value in trained:
        grid.add_row(label, Text(value))
    for label, value in spec_lines(job.get("spec", {}), trained=bool(trained)):
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


# Dropped first, in this order, when the table does not fit the terminal.
SWEEP_SECONDARY = (
    "peak mem",
    "underflow",
    "lost",
    "scale (final/min)",
    "val",
    "step ms",
    "skipped",
)


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
        # At the latest float32-shadow sample: what float16 flushes at the scale, and what
        # the variant itself lost (see `halfway gradients`).
        "underflow": fmt_share(v.get("underflow_share")),
        "lost": fmt_share(v.get("lost_share")),
        "scale (final/min)": scale,
        "peak mem": f"{memory / 2**20:.0f} MiB" if memory is not None else "-",
    }
