"""The slots workers offer (service/scheduling/slots.py) and the queue's ``no slot`` reason, on both
databases: a real supervisor offering its GPUs in its claim and withdrawing them when it stops,
a job needing more GPUs than any live slot waiting with no position and never counted ahead,
and slots that stopped answering no longer counting, unless busy with a job."""

from __future__ import annotations

from sqlalchemy import select, update

from service.database.db import Database
from service.database.dbclock import db_now
from service.database.models import Job, WorkerSlot
from service.scheduling import fairshare, slots
from service.settings import Settings
from tests import fakes
from tests.conftest import Api
from tests.test_claims import claim, make_jobs
from workers.supervisor import Supervisor

RULE = fairshare.Rule(slot_live_seconds=60)


def places(db: Database) -> dict[int, fairshare.Place]:
    with db.read() as s:
        return {p.job_id: p for p in fairshare.queue(s, RULE)}


def offered(db: Database) -> dict[str, int]:
    with db.read() as s:
        return dict(s.execute(select(WorkerSlot.worker_id, WorkerSlot.gpus)).tuples().all())


def two_gpu_supervisor(db: Database, settings: Settings) -> Supervisor:
    return Supervisor(
        db,
        settings,
        trainer=fakes.trainer,
        worker_id="two-gpus",
        gpu_ids=[0, 1],
        memory_probe=lambda ids: dict.fromkeys(ids, 0),  # the GPUs are free
    )


def test_a_worker_offers_its_slot_when_it_claims_and_withdraws_it_when_it_stops(
    db: Database, settings: Settings
) -> None:
    supervisor = two_gpu_supervisor(db, settings)
    assert supervisor.run_once() is False  # nothing queued: it only said it is there
    assert offered(db) == {"two-gpus": 2}
    supervisor.close()
    assert offered(db) == {}


def test_a_job_needing_more_gpus_than_any_slot_waits_for_no_slot(
    db: Database, settings: Settings
) -> None:
    (big,) = make_jobs(db, 1, owner="alice", resources={"gpus": 4})
    (fits, small) = make_jobs(db, 2, owner="bob", resources={"gpus": 2})
    # No worker has said anything yet: nothing is known of the GPUs.
    assert places(db)[big].position == 1 and places(db)[big].reason == "next"

    two_gpu_supervisor(db, settings).run_once()  # claims bob's first job, which it runs
    with db.read() as s:
        assert s.get(Job, fits).status == "succeeded"  # type: ignore[union-attr]
    now = places(db)
    assert now[big].reason == "no slot" and now[big].position is None
    assert now[small].position == 1 and now[small].ahead == 0  # the big job is not ahead

    # A four-GPU worker comes: the big job has a place again.
    with db.write() as s:
        slots.offer(s, worker_id="four-gpus", gpus=4)
    assert places(db)[big].position is not None


def test_a_slot_silent_too_long_stops_counting_unless_it_holds_a_running_job(
    db: Database,
) -> None:
    (big,) = make_jobs(db, 1, owner="alice", resources={"gpus": 4})
    with db.write() as s:
        slots.offer(s, worker_id="w", gpus=1)
    assert places(db)[big].reason == "no slot"
    with db.write() as s:  # its last claim was two minutes ago
        s.execute(update(WorkerSlot).values(seen_at=db_now(-120)))
    assert places(db)[big].reason == "next"  # nothing is known again

    # Busy for hours with a job whose lease it renews: still live.
    (running,) = make_jobs(db, 1, owner="bob")
    assert claim(db, "w").job_id == running  # type: ignore[union-attr]
    assert places(db)[big].reason == "no slot"
    with db.write() as s:  # and the lease lapses: the worker is gone
        s.execute(update(Job).where(Job.id == running).values(lease_expires_at=db_now(-1)))
    assert places(db)[big].reason == "next"


def test_an_offer_forgets_slots_silent_for_a_day(db: Database) -> None:
    with db.write() as s:
        slots.offer(s, worker_id="gone", gpus=8)
        s.execute(update(WorkerSlot).values(seen_at=db_now(-slots.FORGET_AFTER - 60)))
    with db.write() as s:
        slots.offer(s, worker_id="here", gpus=1)
    assert offered(db) == {"here": 1}


def test_the_api_says_why(api: Api, db: Database) -> None:
    job_id = api.post("/v1/jobs", json={"name": "big", "resources": {"gpus": 8}}).json()["id"]
    with db.write() as s:
        slots.offer(s, worker_id="w", gpus=2)
    spot = api.get(f"/v1/jobs/{job_id}").json()["queue"]
    assert spot == {"position": None, "ahead": 0, "reason": "no slot"}
    (item,) = api.get("/v1/queue").json()["items"]
    assert item["reason"] == "no slot"
