"""JSON bodies of history pages, built from plain dicts (a page holds up to ten thousand rows,
and a pydantic object per row would cost several times the query), and the pages pollers
get: from the poll cache without a query, or read once for all pollers at the same cursor.
The tests validate these bodies against the response models' schemas."""

from __future__ import annotations

import json
from typing import Any, Literal

from service.api.etag import etag_of
from service.api.pollcache import PageKey, PollCache
from service.api.responses import json_float, loss_flag
from service.api.routes.jobs import job_snapshot
from service.database.db import Database
from service.recording import columnar, history, rollups

PageKind = Literal["rows", "columns"]


def step_dict(r: history.StepRow) -> dict[str, Any]:
    """A StepOut as a plain dict."""
    return {
        "step": r.step,
        "epoch": r.epoch,
        "loss": json_float(r.loss),
        "loss_nonfinite": loss_flag(r.loss),
        "loss_scale": r.loss_scale,
        "finite": r.finite,
    }


def page_body(
    job_id: int,
    status: str,
    rows: list[history.StepRow],
    after_step: int,
    has_more: bool,
    version: tuple[int, int | None],
) -> bytes:
    """A HistoryPage as JSON. ``version``: the job's history version and reset step, read
    before the rows, so a page never claims a newer version than its rows have."""
    page = {
        "job_id": job_id,
        "status": status,
        "items": [step_dict(r) for r in rows],
        "next_after_step": rows[-1].step if rows else after_step,
        "has_more": has_more,
        "history_version": version[0],
        "history_reset_step": version[1],
    }
    return json.dumps(page, separators=(",", ":"), allow_nan=False).encode()


def bucket_dict(b: rollups.Bucket) -> dict[str, Any]:
    """A BucketOut as a plain dict."""
    return {
        "index": b.index,
        "first_step": b.first_step,
        "last_step": b.last_step,
        "count": b.count,
        "loss_min": b.loss_min,
        "loss_max": b.loss_max,
        "loss_last": json_float(b.loss_last),
        "loss_last_nonfinite": loss_flag(b.loss_last),
        "scale_min": b.scale_min,
        "scale_max": b.scale_max,
        "scale_last": b.scale_last,
        "overflow_count": b.overflow_count,
        "nonfinite_loss_count": b.nonfinite_loss_count,
    }


def cached_page(
    cache: PollCache, job_id: int, after_step: int, limit: int, kind: PageKind
) -> tuple[bytes, str] | None:
    """A poller's page (body, ETag) as of the job's fresh snapshot, with no query: the empty
    page for a poller that already has every row the snapshot knows of, or the page another
    poller at the same cursor had read. None when the database must be asked."""
    snap = cache.fresh(job_id)
    if snap is None:
        return None
    if snap.last_step is None or after_step >= snap.last_step:
        version = (snap.history_version, snap.history_reset_step)
        if kind == "rows":
            body = page_body(job_id, snap.status, [], after_step, False, version)
        else:
            empty = columnar.Slice(columnar.Columns.empty(), after_step, None)
            body = columnar.columns_body(job_id, snap.status, empty, after_step, version)
        return body, etag_of(body, snap.history_version)
    page = cache.page((kind, job_id, after_step, limit), snap)
    return None if page is None else (page.body, page.etag)


def polled_page(
    db: Database, cache: PollCache, job_id: int, after_step: int, limit: int, kind: PageKind
) -> tuple[bytes, str]:
    """New rows for a poller, cut at the job's snapshot so that pollers' cursors meet and one
    query (one at a time, by single flight) answers all of those at the same step. Blocking:
    call it in a thread."""
    snap = job_snapshot(db, cache, job_id)
    key: PageKey = (kind, job_id, after_step, limit)
    with cache.single_flight(key):
        page = cache.page(key, snap)
        if page is None:
            version = (snap.history_version, snap.history_reset_step)
            with db.read() as session:
                if kind == "rows":
                    rows, has_more = history.read_steps(
                        session, job_id, after_step=after_step, limit=limit, up_to=snap.last_step
                    )
                    body = page_body(job_id, snap.status, rows, after_step, has_more, version)
                else:
                    up_to = -1 if snap.last_step is None else snap.last_step
                    found = columnar.read_columns(
                        session, job_id, after_step=after_step, limit=limit, up_to=up_to
                    )
                    body = columnar.columns_body(job_id, snap.status, found, after_step, version)
            page = cache.store_page(key, snap, body, snap.history_version)
    return page.body, page.etag
