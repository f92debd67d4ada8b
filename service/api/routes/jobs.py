"""Job endpoints: submit, list, read (with ETag), cancel, change priority.

A queued job's answer carries its place in the claim order (``queue``:
service/scheduling/fairshare.py), computed with the app's fair-share rule (``use_rule``; the
default rule until one is set), so every path that builds a job's snapshot (the routes, the lean
polls, the pages) shows the same place.
"""

from __future__ import annotations

import hashlib
import json
import time
from functools import partial
from typing import Annotated, Any, Literal
from weakref import WeakKeyDictionary

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import Field
from sqlalchemy import Row
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.api import joblist
from service.api.deps import (
    MAX_ID,
    DbDep,
    JobId,
    PollCacheDep,
    PrincipalDep,
    SettingsDep,
    WriteSessionDep,
)
from service.api.etag import etag_response, respond, serialize
from service.api.pollcache import Listing, ListKey, PollCache, Snapshot
from service.api.responses import (
    GradientsSummary,
    JobOut,
    JobPage,
    PrecisionDecisionOut,
    PreemptionOut,
    Progress,
    QueueSpot,
    Summary,
    error_responses,
    json_float,
    loss_flag,
)
from service.database.db import Database
from service.database.models import Job, utcnow
from service.errors import Conflict
from service.people import grants
from service.people.auth import require_owner_or_admin
from service.scheduling import fairshare, jobs
from service.specs import normalization
from service.specs.schemas import JobSpec, StrictModel, SubmitResult

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
LIST_LIMIT = 50  # the job list's page size when the query names none

# The fair-share rule of each app, by its poll cache: the one object every snapshot path is
# handed along with the database (service/api/routes/queue.py ``install`` sets it).
_RULES: WeakKeyDictionary[PollCache, fairshare.Rule] = WeakKeyDictionary()


def use_rule(cache: PollCache, rule: fairshare.Rule) -> None:
    _RULES[cache] = rule


def rule_of(cache: PollCache) -> fairshare.Rule:
    return _RULES.get(cache, fairshare.Rule())


# The whole queue's places, kept as long as a snapshot is (the cache's age): every queued job's
# snapshot and every listing needs the whole order, and a long queue's costs a fair part of a
# second (benchmarks/claim.py), so two hundred queued jobs polled pay it once, not each.
_PLACES: WeakKeyDictionary[PollCache, tuple[float, dict[int, fairshare.Place]]] = (
    WeakKeyDictionary()
)


def places(
    session: Session, cache: PollCache, job_id: int | None = None
) -> dict[int, fairshare.Place]:
    """The queue's places by job id: the kept ones while young and holding ``job_id``."""
    kept = _PLACES.get(cache)
    now = time.monotonic()
    if kept is not None and now - kept[0] < cache.ttl and (job_id is None or job_id in kept[1]):
        return kept[1]
    fresh = {p.job_id: p for p in fairshare.queue(session, rule_of(cache))}
    _PLACES[cache] = (now, fresh)
    return fresh


def queue_spot(place: fairshare.Place | None) -> QueueSpot | None:
    if place is None or place.status != "queued":
        return None
    return QueueSpot(position=place.position, ahead=place.ahead, reason=place.reason)


def job_out(job: Job) -> JobOut:
    done = job.last_step + 1 if job.last_step is not None else (0 if job.started_at else None)
    loss = job.last_loss if job.last_step is not None else None
    return JobOut(
        id=job.id,
        name=job.name,
        owner=job.owner,
        status=job.status,
        priority=job.priority,
        attempt=job.attempt,
        max_attempts=job.max_attempts,
        worker_id=job.worker_id,
        cancel_requested=job.cancel_requested,
        error=job.error,
        attempt_errors=job.attempt_errors,
        warnings=job.warnings,
        notes=job.notes,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        progress=Progress(
            step=done,
            total_steps=job.total_steps,
            fraction=(
                min(1.0, done / job.total_steps) if done is not None and job.total_steps else None
            ),
            epoch=job.epoch,
        ),
        summary=Summary(
            last_step=job.last_step,
            last_loss=json_float(loss),
            last_loss_nonfinite=loss_flag(loss),
            loss_scale=job.loss_scale,
            min_loss_scale=job.min_loss_scale,
            overflow_count=job.overflow_count,
            growth_count=job.growth_count,
            backoff_count=job.backoff_count,
            nonfinite_loss_count=job.nonfinite_loss_count,
            steps_per_second=job.steps_per_second,
            guard_warning=job.guard_warning,
            checkpoint_step=job.checkpoint_step,
            metrics=job.metrics,
        ),
        sweep_id=job.sweep_id,
        precision_report=job.precision_report,
        forensics=job.forensics,
        device=job.device,
        spec=job.spec,
        history_version=job.history_version,
        history_reset_step=job.history_reset_step,
        preemptions=[PreemptionOut.model_validate(p) for p in job.preemptions],
        gradients=(
            None
            if job.gradients_summary is None
            else GradientsSummary.model_validate(job.gradients_summary)
        ),
        precision_decision=(
            None
            if job.precision_decision is None
            else PrecisionDecisionOut.model_validate(job.precision_decision)
        ),
    )


@router.post(
    "",
    status_code=201,
    response_model=JobOut,
    responses={
        200: {
            "model": SubmitResult | JobOut,
            "description": "dry_run: the normalized spec, nothing stored; or the job an "
            "earlier request with the same Idempotency-Key created",
        },
        **error_responses(401, 403, 409, 413, 422),
    },
)
def submit_job(
    spec: JobSpec,
    session: WriteSessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    cache: PollCacheDep,
    dry_run: Annotated[bool, Query(description="Validate and normalize; store nothing.")] = False,
    idempotency_key: Annotated[
        str | None, Header(min_length=1, max_length=200, pattern=r"^[\x21-\x7e]+$")
    ] = None,
) -> Response:
    if spec.code is not None:
        grants.require_code_right(session, principal, settings.code_jobs)
    submitted = normalization.normalize(spec, settings)
    if dry_run:
        return JSONResponse(submitted.model_dump(mode="json"), status_code=200)
    body_hash = hashlib.sha256(spec.model_dump_json().encode()).hexdigest()
    if idempotency_key is not None:
        earlier = jobs.find_by_idempotency_key(session, principal.name, idempotency_key)
        if earlier is not None:
            return _replay(earlier, body_hash)
    try:
        job = jobs.create_job(
            session,
            owner=principal.name,
            submitted=submitted,
            now=utcnow(),
            idempotency_key=idempotency_key,
            body_hash=body_hash,
        )
        session.commit()
        cache.forget()  # the lists now hold it
    except IntegrityError:
        # Another request with the same key won the race; answer as it did.
        session.rollback()
        assert idempotency_key is not None
        earlier = jobs.find_by_idempotency_key(session, principal.name, idempotency_key)
        if earlier is None:
            raise
        return _replay(earlier, body_hash)
    return JSONResponse(
        job_out(job).model_dump(mode="json"),
        status_code=201,
        headers={"Location": f"/v1/jobs/{job.id}"},
    )


def _replay(earlier: Job, body_hash: str) -> Response:
    if earlier.body_hash != body_hash:
        raise Conflict(
            "Idempotency-Key was already used with a different body "
            f"(job {earlier.id}); use a new key for a new job",
            field="Idempotency-Key",
        )
    return JSONResponse(
        job_out(earlier).model_dump(mode="json"),
        status_code=200,
        headers={"Idempotent-Replayed": "true", "Location": f"/v1/jobs/{earlier.id}"},
    )


@router.get(
    "",
    response_model=JobPage,
    responses={304: {"description": "Not modified (If-None-Match)"}, **error_responses(401, 422)},
)
async def list_jobs(
    request: Request,
    db: DbDep,
    cache: PollCacheDep,
    _: PrincipalDep,
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"] | None = None,
    owner: Annotated[str | None, Query(max_length=64)] = None,
    cursor: Annotated[str | None, Query(pattern=r"^[0-9]{1,12}$")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = LIST_LIMIT,
) -> Response:
    # Async, from the poll cache as a job is: every dashboard reads this list on every
    # refresh, and loading and encoding a hundred jobs costs a hundred job snapshots.
    if owner is not None and "\x00" in owner:
        # No user name holds a NUL, and PostgreSQL refuses one in a query.
        return etag_response(request, JobPage(items=[], next_cursor=None))
    before_id = int(cursor) if cursor else None
    if before_id is not None and before_id > MAX_ID:
        before_id = None  # every id is below it (ids are 32-bit)
    key: ListKey = (status, owner, before_id, limit)
    listing = cache.fresh_listing(key)
    if listing is None:
        listing = await run_in_threadpool(job_listing, db, cache, key)
    return respond(request, listing.body, listing.etag)


def job_listing(db: Database, cache: PollCache, key: ListKey) -> Listing:
    """A page of the job list: the cached one, or read from the database (single flight)."""
    status, owner, before_id, limit = key

    def load() -> bytes:
        with db.read() as session:
            rows, next_id = joblist.list_rows(
                session, status=status, owner=owner, before_id=before_id, limit=limit
            )
            where: dict[int, fairshare.Place] = {}
            if any(row.status == "queued" for row in rows):
                where = places(session, cache)
        items = []
        for row in rows:
            spot = queue_spot(where.get(row.id))
            # The place moves while the row stays: it is part of what the JSON is made from.
            made_of = joblist.fingerprint(row) + (b"" if spot is None else serialize(spot))
            items.append(cache.item(row.id, made_of, partial(_encoded, row, spot)))
        return page_text(items, str(next_id) if next_id else None)

    return cache.listing(key, load)


def _encoded(row: Row[Any], spot: QueueSpot | None) -> bytes:
    return serialize(queued_out(joblist.job_of(row), spot))


def queued_out(job: Job, spot: QueueSpot | None) -> JobOut:
    """``job_out`` with the job's place in the queue, if it has one."""
    out = job_out(job)
    return out if spot is None else out.model_copy(update={"queue": spot})


def page_text(items: list[bytes], next_cursor: str | None) -> bytes:
    """``serialize(JobPage(...))`` of items already encoded, byte for byte."""
    tail = json.dumps(next_cursor).encode()
    return b'{"items":[' + b",".join(items) + b'],"next_cursor":' + tail + b"}"


@router.get(
    "/{job_id}",
    response_model=JobOut,
    responses={
        304: {"description": "Not modified (If-None-Match)"},
        **error_responses(401, 404, 422),
    },
)
async def get_job(
    job_id: JobId,
    request: Request,
    db: DbDep,
    cache: PollCacheDep,
    _: PrincipalDep,
) -> Response:
    # Async: a poll inside the snapshot's lifetime is answered on the event loop, with no
    # thread hop and no query; only a stale snapshot reads the database (in a thread).
    snap = cache.fresh(job_id)
    if snap is None:
        snap = await run_in_threadpool(job_snapshot, db, cache, job_id)
    return respond(request, snap.body, snap.etag)


def job_snapshot(db: Database, cache: PollCache, job_id: int) -> Snapshot:
    """The job's poll snapshot: the cached one, or read from the database (single flight)."""

    def load() -> JobOut:
        with db.read() as session:
            job = jobs.get_job(session, job_id)
            spot = None
            if job.status == "queued":
                spot = queue_spot(places(session, cache, job_id).get(job_id))
            return queued_out(job, spot)

    return cache.snapshot(job_id, load)


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=JobOut,
    responses=error_responses(401, 403, 404, 409, 422),
)
def cancel_job(
    job_id: JobId, session: WriteSessionDep, cache: PollCacheDep, principal: PrincipalDep
) -> JobOut:
    job = jobs.get_job(session, job_id)
    require_owner_or_admin(principal, job.owner, "cancel")
    job = jobs.request_cancel(session, job_id, utcnow())
    session.commit()
    cache.forget(job_id)
    return job_out(job)


class JobPatch(StrictModel):
    priority: int = Field(ge=0, le=100, description="0..100, higher runs first.")


@router.patch(
    "/{job_id}",
    response_model=JobOut,
    responses=error_responses(401, 403, 404, 409, 413, 422),
)
def patch_job(
    job_id: JobId,
    patch: JobPatch,
    session: WriteSessionDep,
    cache: PollCacheDep,
    principal: PrincipalDep,
) -> JobOut:
    job = jobs.get_job(session, job_id)
    require_owner_or_admin(principal, job.owner, "change the priority of")
    job = jobs.set_priority(session, job_id, patch.priority, utcnow())
    session.commit()
    cache.forget(job_id)
    return job_out(job)
