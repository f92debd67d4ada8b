"""A running attempt's periodic look at preemption (service/scheduling/preemption.py), riding the
supervisor's periodic sync: at most every ``interval`` seconds, one short write transaction
that makes the request the rule makes now and reads whether this attempt's job is asked to
stop. No TensorFlow."""

from __future__ import annotations

import logging
import time

from sqlalchemy.exc import DBAPIError

from service.database.db import Database
from service.scheduling import preemption
from service.settings import Settings
from workers.attempt import Attempt

log = logging.getLogger("halfway.worker")


def interval(settings: Settings) -> float:
    """How often a running attempt looks: a waiting job must wait ``preempt_wait`` anyway,
    so a few looks in that time are enough; never more often than an idle worker polls."""
    return max(settings.poll_seconds, settings.preempt_wait / 3)


def look(db: Database, settings: Settings, worker_id: str, run: Attempt) -> bool:
    """Whether ``run`` must stop now for a waiting job (``run.preempted`` says which)."""
    if settings.preemption != "on" or run.preempted is not None:
        return False
    if run.cancel_requested or run.shutting_down or run.lease_lost:
        return False
    now = time.monotonic()
    if now - run.preempt_looked_at < interval(settings):
        return False
    run.preempt_looked_at = now
    rule = preemption.Rule.from_settings(settings)
    try:
        with db.write() as session:
            asked = preemption.check(session, rule, job_id=run.job_id, worker_id=worker_id)
    except DBAPIError as exc:  # the next look tries again; the sync reports outages
        log.debug("job %s: preemption look failed: %s", run.job_id, exc.orig)
        return False
    if asked is None:
        return False
    run.preempted = asked
    log.info(
        "job %s: preempted for job %s (%s); stopping at the next checkpoint",
        run.job_id,
        asked.by_job,
        asked.reason,
        extra={"job_id": run.job_id, "worker_id": worker_id},
    )
    return True
