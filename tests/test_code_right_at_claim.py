"""The right to run code is checked when a worker claims a code job, not only when the job is
submitted: a right revoked (or a policy tightened, a user disabled or removed) while the job
waits in the queue fails it with an error naming the right, and no training child starts.
A job whose owner still holds the right runs, and so does one submitted with
authentication off."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.database.db import Database
from service.database.models import Job
from service.people import auth, grants
from service.settings import Settings
from tests import fakes
from tests.conftest import Api, Team
from tests.test_code_bundles import tar_gz
from workers.launchers import Handle, Trainer
from workers.supervisor import Supervisor

BUNDLE = {"pkg/__init__.py": b"", "pkg/train.py": b"def build(args):\n    return {}\n"}
Policy = Literal["admins", "members", "off"]


def code_spec(digest: str) -> dict[str, Any]:
    return {"code": {"bundle": digest, "entrypoint": "pkg.train:build"}}


def submit_code_job(api: Api) -> int:
    up = api.post("/v1/code", files={"file": ("code.tar.gz", tar_gz(BUNDLE))})
    assert up.status_code in (200, 201), up.text
    r = api.post("/v1/jobs", json=code_spec(up.json()["digest"]))
    assert r.status_code == 201, r.text
    job_id: int = r.json()["id"]
    return job_id


class Worker:
    """A supervisor with the fake trainer, counting the training children it starts."""

    def __init__(self, db: Database, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
        self.supervisor = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w-claim")
        self.started: list[int] = []
        real = self.supervisor.launcher.start

        def start(trainer: Trainer, payload: dict[str, Any], **kw: Any) -> Handle:
            self.started.append(payload["job_id"])
            return real(trainer, payload, **kw)

        monkeypatch.setattr(self.supervisor.launcher, "start", start)

    def run_once(self) -> None:
        assert self.supervisor.run_once()


def load(db: Database, job_id: int) -> Job:
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job


@pytest.fixture
def alice_may_code(db: Database, team: Team) -> None:
    with db.write() as session:
        grants.grant(session, "alice", "code")


@pytest.mark.usefixtures("alice_may_code")
def test_a_code_job_whose_right_was_revoked_before_a_worker_claimed_it_fails_unrun(
    api: Api, db: Database, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = submit_code_job(api)
    with db.write() as session:
        assert grants.revoke(session, "alice", "code")
    worker = Worker(db, settings, monkeypatch)
    worker.run_once()
    job = load(db, job_id)
    assert job.status == "failed", job.error
    assert job.error is not None
    assert "alice does not hold the code right" in job.error, job.error
    assert "halfway users grant alice code" in job.error
    assert [e["error"] for e in job.attempt_errors] == [job.error]
    assert worker.started == []  # no child: none of the bundle's code ran
    assert job.last_step is None and job.finished_at is not None


@pytest.mark.usefixtures("alice_may_code")
def test_a_code_job_whose_owner_still_holds_the_right_runs(
    api: Api, db: Database, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = submit_code_job(api)
    worker = Worker(db, settings, monkeypatch)
    worker.run_once()
    job = load(db, job_id)
    assert job.status == "succeeded", job.error
    assert worker.started == [job_id] and job.last_step == 9  # the fake trainer's 10 steps


@pytest.mark.usefixtures("alice_may_code")
def test_the_policy_as_it_stands_when_a_worker_claims_decides(
    api: Api, team: Team, db: Database, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    admins_job = submit_code_job(api.as_user(team.admin))
    plain_job = api.post("/v1/jobs", json={}).json()["id"]  # a preset needs no right
    off = settings.model_copy(update={"code_jobs": "off"})
    worker = Worker(db, off, monkeypatch)
    worker.run_once()
    worker.run_once()
    refused = load(db, admins_job)
    assert refused.status == "failed" and refused.error is not None
    assert "HALFWAY_CODE_JOBS=off" in refused.error, refused.error
    assert load(db, plain_job).status == "succeeded"
    assert worker.started == [plain_job]


def test_a_code_job_submitted_with_authentication_off_runs(
    db: Database, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    with TestClient(create_app(settings, db, auth=False)) as c:
        job_id = submit_code_job(Api(c, None))
    worker = Worker(db, settings, monkeypatch)
    worker.run_once()
    assert load(db, job_id).owner == "local"
    assert load(db, job_id).status == "succeeded", load(db, job_id).error
    assert worker.started == [job_id]


@pytest.fixture
def people(db: Database) -> Iterator[None]:
    with db.write() as session:
        auth.add_user(session, "root", admin=True)
        auth.add_user(session, "granted")
        auth.add_user(session, "plain")
        auth.add_user(session, "gone")
        auth.add_user(session, "disabled", admin=True)
        grants.grant(session, "granted", "code")
        auth.remove_user(session, "gone")
        auth.set_disabled(session, "disabled", True)
    yield


# Who may run code at claim time: (owner, policy) -> the refusal's words, or None to run.
TABLE: list[tuple[str, Policy, str | None]] = [
    ("root", "admins", None),
    ("root", "members", None),
    ("root", "off", "HALFWAY_CODE_JOBS=off"),
    ("granted", "admins", None),
    ("granted", "off", "HALFWAY_CODE_JOBS=off"),
    ("plain", "admins", "plain does not hold the code right"),
    ("plain", "members", None),
    ("gone", "members", "gone is no longer a user"),
    ("disabled", "admins", "disabled is disabled"),
    ("local", "admins", None),  # authentication off: no user row, an admin
    ("local", "off", "HALFWAY_CODE_JOBS=off"),
]


@pytest.mark.usefixtures("people")
@pytest.mark.parametrize(("owner", "policy", "says"), TABLE)
def test_who_may_run_code_when_a_worker_claims(
    db: Database, owner: str, policy: Policy, says: str | None
) -> None:
    with db.read() as session:
        refusal = grants.code_refusal(session, owner, policy)
    if says is None:
        assert refusal is None
    else:
        assert refusal is not None and says in refusal, refusal
