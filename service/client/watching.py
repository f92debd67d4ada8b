"""Following a job or a sweep from the command line: the watch loops that poll with ETags
(a briefly unreachable server is retried), and the log that follows its offset."""

from __future__ import annotations

import time
from typing import Any, BinaryIO

from rich.markup import escape

from service.client import render
from service.client.api import Client, Job
from service.client.errors import HalfwayError
from service.client.render import Ui
from service.vocabulary import FINISHED_STATUSES

POLL_SECONDS = 1.0
# A watch survives a server restart or a database blip this long before giving up.
WATCH_PATIENCE_SECONDS = 60.0


def watch_job(client: Client, job: Job, ui: Ui) -> Job:
    """Draw the job until it finishes, polling about every ``POLL_SECONDS``; an unchanged job
    costs an empty 304 thanks to its ETag."""
    with render.progress_bar(ui) as progress:
        task = progress.add_task("", total=None, **render.bar_fields(job))
        last = job
        warned = False

        def draw(fresh: Job) -> None:
            nonlocal last
            for line in render.changes(last, fresh):
                progress.console.print(escape(line))
            last = fresh
            done = fresh["progress"]["step"] or 0
            progress.update(
                task,
                completed=done,
                total=fresh["progress"]["total_steps"],
                **render.bar_fields(fresh),
            )

        def retrying(error: HalfwayError) -> None:
            nonlocal warned
            if not warned:
                progress.console.print(
                    f"[yellow]{escape(error.message)}; retrying for up to "
                    f"{WATCH_PATIENCE_SECONDS:.0f} s[/]"
                )
                warned = True

        return client.wait(
            job["id"],
            draw,
            poll_seconds=POLL_SECONDS,
            patience_seconds=WATCH_PATIENCE_SECONDS,
            on_retry=retrying,
        )


def watch_sweep(client: Client, created: dict[str, Any], ui: Ui) -> dict[str, Any]:
    """Draw a bar per variant (status, steps, last loss, scale, overflows) and print each
    change above them until every variant's job has finished; return the sweep's table. Each
    job is polled with its ETag, so an unchanged one costs an empty 304."""
    prefix = f"{created['name']}/"
    names = {v["job_id"]: v["name"].removeprefix(prefix) for v in created["variants"]}
    etags: dict[int, str | None] = dict.fromkeys(names)
    last: dict[int, Job] = {}
    warned = False
    with render.sweep_bars(ui) as bars:

        def retrying(error: HalfwayError) -> None:
            nonlocal warned
            if not warned:
                bars.console.print(
                    f"[yellow]{escape(error.message)}; retrying for up to "
                    f"{WATCH_PATIENCE_SECONDS:.0f} s[/]"
                )
                warned = True

        tasks = {
            job_id: bars.add_task("", total=None, start=False, **render.variant_fields(name, None))
            for job_id, name in names.items()
        }
        pending = list(names)
        while pending:
            for job_id in list(pending):
                job, etags[job_id] = client.poll_job(
                    job_id,
                    etags[job_id],
                    patience_seconds=WATCH_PATIENCE_SECONDS,
                    retry_seconds=POLL_SECONDS,
                    on_retry=retrying,
                )
                if job is None:
                    continue
                name, task = names[job_id], tasks[job_id]
                for line in render.variant_changes(name, last.get(job_id), job):
                    bars.console.print(escape(line))
                last[job_id] = job
                if job["status"] != "queued":
                    bars.start_task(task)
                bars.update(
                    task,
                    completed=job["progress"]["step"] or 0,
                    total=job["progress"]["total_steps"],
                    **render.variant_fields(name, job),
                )
                if job["status"] in FINISHED_STATUSES:
                    bars.stop_task(task)
                    pending.remove(job_id)
            if pending:
                time.sleep(POLL_SECONDS)
    # The table is read from the same jobs: done, but for a cache's lag.
    deadline = time.monotonic() + WATCH_PATIENCE_SECONDS
    table = client.get_sweep(created["id"])
    while not table["done"] and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
        table = client.get_sweep(created["id"])
    return table


def follow_log(client: Client, job_id: int, offset: int, out: BinaryIO) -> str:
    """Print new log bytes as they come; stop once the job has finished and no more come.
    The log is complete before the job's status is final (the child writes it, and the
    supervisor ends the job after the child exits), so one more read after that suffices."""
    etag: str | None = None
    status = ""
    while True:
        data, offset = client.logs(job_id, offset)
        if data:
            render.write_bytes(out, data)
            continue
        if status in FINISHED_STATUSES:
            return status
        job, etag = client.job_if_changed(job_id, etag)
        if job is not None:
            status = job["status"]
        if status not in FINISHED_STATUSES:
            time.sleep(POLL_SECONDS)
