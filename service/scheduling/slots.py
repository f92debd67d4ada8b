"""The training slots workers offer, so that the queue can say when a job needs more GPUs than
any slot holds (docs/scheduling.md).

Each supervisor says it is there, and how many GPUs it holds, in every claim it tries
(``offer``, inside the claim's own transaction: no extra round trip), and says it has gone when
it stops (``withdraw``). A slot is live while it was seen within the last ``live_seconds``, or
while it holds a running job whose lease is live: a slot busy for hours claims nothing, but its
lease is renewed. Every time is the database's, as for leases.
"""

from __future__ import annotations

from sqlalchemy import and_, delete, exists, func, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.database.dbclock import db_now
from service.database.models import Job, WorkerSlot

# A slot not seen for this long is deleted by the next offer: a worker killed without its
# clean stop leaves no row for ever.
FORGET_AFTER = 86400.0


def offer(session: Session, *, worker_id: str, gpus: int) -> None:
    """Record that ``worker_id`` offers a slot of ``gpus`` GPUs, now."""
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(WorkerSlot).values(worker_id=worker_id, gpus=gpus, seen_at=db_now())
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["worker_id"],
            set_={"gpus": stmt.excluded.gpus, "seen_at": stmt.excluded.seen_at},
        )
    )
    session.execute(delete(WorkerSlot).where(WorkerSlot.seen_at < db_now(-FORGET_AFTER)))


def withdraw(session: Session, *, worker_id: str) -> None:
    session.execute(delete(WorkerSlot).where(WorkerSlot.worker_id == worker_id))


def largest(session: Session, *, live_seconds: float) -> int | None:
    """The most GPUs a live slot holds; None when no slot is live (no worker is up, or none
    has said so yet): then nothing can be said about GPUs."""
    busy = exists().where(
        Job.worker_id == WorkerSlot.worker_id,
        and_(Job.status == "running", Job.lease_expires_at >= db_now()),
    )
    live = or_(WorkerSlot.seen_at >= db_now(-live_seconds), busy)
    most: int | None = session.scalar(select(func.max(WorkerSlot.gpus)).where(live))
    return most
