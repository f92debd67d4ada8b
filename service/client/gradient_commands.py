"""``halfway gradients ID``: a job's gradient samples as tables (``service.client.gradient_tables``
formats them): the whole model's figures at each sampled step, paged like ``halfway history``;
``--variables`` adds each variable's figures at the job's latest sample, ``--step N`` shows
the sample at step N with its variables."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from service.client import render
from service.client.api import Client, Job
from service.client.errors import NotFound, UsageError
from service.client.gradient_tables import samples_table, variables_table
from service.client.options import JobId, TokenOption, UrlOption, handles_errors
from service.client.render import Ui

DEFAULT_LIMIT = 50


def sample_at(client: Client, job_id: int, step: int) -> dict[str, Any] | None:
    """The sample recorded at ``step`` (with its variables), or None if none was."""
    page = client.gradient_page(job_id, after_step=step - 1, limit=1)
    found = [s for s in page["samples"] if s["step"] == step]
    return found[0] if found else None


def _none_yet(ui: Ui, job: Job, after: int) -> None:
    ui.out.print(f"Job {job['id']} has no gradient samples after step {after} ({job['status']}).")
    section = (job.get("spec") or {}).get("gradients", {})
    every, shadow_every = section.get("every"), section.get("shadow_every")
    if every == 0 and shadow_every == 0:
        ui.out.print(
            "[dim]Its spec turns the meter off (gradients.every and shadow_every are 0).[/]"
        )
    elif every == 0:
        ui.out.print(
            f"[dim]It samples only at its float32-shadow steps, every {shadow_every} steps, "
            "from step 0.[/]"
        )
    elif every:
        ui.out.print(f"[dim]It samples every {every} steps, from step 0.[/]")


@handles_errors
def gradients(
    job_id: JobId,
    variables: Annotated[
        bool,
        typer.Option(
            "--variables", help="Also each variable's figures at the job's latest sample."
        ),
    ] = False,
    step: Annotated[
        int | None,
        typer.Option(
            help="Only the sample at step N, with each variable's figures.",
            min=0,
            metavar="N",
            show_default=False,
        ),
    ] = None,
    after_step: Annotated[
        int | None,
        typer.Option(help="Samples after this step (default: from the start).", min=-1),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(help=f"Samples to print (default {DEFAULT_LIMIT}).", min=1, max=1000),
    ] = None,
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """A job's gradient samples: the whole model's figures at each sampled step. Shares are
    percentages, magnitudes powers of two, headroom the doublings left before float16's
    largest value (65504); underflow, lost and relative error come from the float32 shadow."""
    if step is not None and (after_step is not None or limit is not None):
        raise UsageError("--step shows one sample; not with --after-step or --limit")
    ui = Ui.create()
    with Client(url, token) as client:
        job = client.job(job_id)
        if step is not None:
            sample = sample_at(client, job_id, step)
            if sample is None:
                raise NotFound(
                    f"job {job_id} has no gradient sample at step {step}",
                    [f"Its sampled steps: halfway gradients {job_id}"],
                )
            ui.out.print(samples_table(job_id, [sample], job["status"]))
            ui.out.print(variables_table(job_id, sample))
            return
        after = -1 if after_step is None else after_step
        page = client.gradient_page(job_id, after_step=after, limit=limit or DEFAULT_LIMIT)
        latest = (job.get("gradients") or {}).get("latest")
        last = sample_at(client, job_id, latest["step"]) if variables and latest else None
    if not page["samples"]:
        _none_yet(ui, job, after)
        return
    ui.out.print(samples_table(job_id, page["samples"], job["status"]))
    render.print_rewrite(ui, {**page, "history_reset_step": job.get("history_reset_step")})
    if page.get("next_after_step") is not None:
        ui.out.print(
            f"[dim]More: halfway gradients {job_id} --after-step {page['next_after_step']}[/]"
        )
    if last is not None:
        ui.out.print(variables_table(job_id, last))
