"""The walls around a training child, piece by piece: the allow-listed environment, how the
isolation mode is chosen and announced, the scratch folder read without following the child's
links, and store writes fenced by the lease (an attempt that lost its job writes nothing a
resume reads). The whole picture, with a hostile bundle and real Keras, is
tests/test_isolation.py."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from service.database.db import Database
from service.database.models import Job, utcnow
from service.files import codestore
from service.files.code import Limits
from service.files.storage import FileStore, open_storage
from service.scheduling import jobs
from service.settings import Settings
from service.specs.schemas import JobSpec, SubmitResult
from tests import fakes
from tests.test_code_bundles import tar_gz
from tests.test_code_right_at_claim import BUNDLE
from tests.test_supervisor import load, make_job, step_count, wait_for
from workers import checkpoints, sandbox
from workers.staging import JobFiles, UnsafeOutput
from workers.supervisor import Supervisor

# --------------------------------------------------------------------------------------------
# The environment


def test_the_childs_environment_holds_only_allow_listed_names() -> None:
    server = {
        "HALFWAY_DATABASE_URL": "postgresql://halfway:pw@db/halfway",
        "HALFWAY_TOKEN": "tok",
        "DATABASE_URL": "postgresql://x",
        "PGPASSWORD": "pw",
        "AWS_ACCESS_KEY_ID": "key",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "MINIO_ROOT_PASSWORD": "root",
        "GITHUB_TOKEN": "gh",
        "HOME": "/root",
        "PATH": "/root/bin:/usr/bin",
        "PYTHONPATH": "/srv/secrets",
        "LD_PRELOAD": "/tmp/evil.so",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "OMP_NUM_THREADS": "2",
        "OPENBLAS_CORETYPE": "Haswell",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "NVIDIA_VISIBLE_DEVICES": "all",
    }
    env = sandbox.child_env(server, home=Path("/job"), gpu_ids=[1])
    kept = {"TF_CPP_MIN_LOG_LEVEL", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE", "LANG", "LC_ALL"}
    assert {k: env[k] for k in kept} == {k: server[k] for k in kept}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    for secret in ("pw", "tok", "key", "secret", "root", "gh", "/srv/secrets", "/tmp/evil.so"):
        assert all(secret not in value for value in env.values()), secret
    assert env["HOME"] == "/job" and env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert not [k for k in env if k.startswith("HALFWAY_")]


# --------------------------------------------------------------------------------------------
# Choosing and announcing the mode


def test_auto_takes_bubblewrap_where_it_works_and_announces_none_where_it_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This machine has bubblewrap (the CI installs it): auto is the strong mode.
    assert sandbox.probe() is None
    strong = sandbox.resolve("auto")
    assert strong.mode == "bubblewrap" and strong.warning is None
    monkeypatch.setattr(sandbox, "probe", lambda: "bwrap is not installed")
    weak = sandbox.resolve("auto")
    assert weak.mode == "none"
    assert weak.warning is not None and "bwrap is not installed" in weak.warning
    with pytest.raises(sandbox.IsolationUnavailable, match="bwrap is not installed"):
        sandbox.resolve("bubblewrap")
    assert sandbox.resolve("none").mode == "none"


def _code_job(db: Database, settings: Settings) -> int:
    """A code job whose bundle is in the store (the fake trainer ignores it)."""
    buffer = io.BytesIO(tar_gz(BUNDLE))
    storage = open_storage(settings.storage_config())
    bundle = codestore.upload(
        buffer, storage.code, settings.resolved_code_dir(), Limits(10**7, 100, 100.0)
    )
    spec = {"code": {"bundle": bundle.digest, "entrypoint": "pkg.train:build"}}
    submitted = SubmitResult(spec=JobSpec.model_validate(spec), warnings=[], notes=[])
    with db.write() as s:
        return jobs.create_job(s, owner="local", submitted=submitted, now=utcnow()).id


def test_a_worker_without_isolation_says_so_at_start_and_on_every_code_job(
    db: Database, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    weak = settings.model_copy(update={"code_isolation": "none"})
    with caplog.at_level(logging.WARNING, logger="halfway.worker"):
        supervisor = Supervisor(db, weak, trainer=fakes.trainer)
    assert "training children run without isolation" in caplog.text
    code_job = _code_job(db, weak)
    preset = make_job(db, {})
    assert supervisor.run_once() and supervisor.run_once()
    warned = load(db, code_job)
    assert warned.status == "succeeded", warned.error
    assert any("without isolation" in w for w in warned.warnings)
    assert not any("without isolation" in w for w in load(db, preset).warnings)


def test_an_isolated_worker_announces_nothing(db: Database, settings: Settings) -> None:
    supervisor = Supervisor(db, settings, trainer=fakes.trainer)
    assert supervisor.isolation is not None and supervisor.isolation.mode == "bubblewrap"
    code_job = _code_job(db, settings)
    assert supervisor.run_once()
    job = load(db, code_job)
    assert job.status == "succeeded", job.error
    assert not any("isolation" in w for w in job.warnings)


# --------------------------------------------------------------------------------------------
# The scratch folder is the child's: nothing in it is followed


@pytest.fixture
def attempt(tmp_path: Path) -> JobFiles:
    store = FileStore(tmp_path / "store")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    return JobFiles(store, "7", scratch)


def test_a_saved_file_that_links_out_of_scratch_is_refused_not_copied(
    attempt: JobFiles, tmp_path: Path
) -> None:
    server_file = tmp_path / "halfway.db"
    server_file.write_bytes(b"the server's database")
    (attempt.scratch / "model.keras").symlink_to(server_file)
    (attempt.scratch / "out").symlink_to(tmp_path)  # a linked folder on the way
    for name in ("model.keras", "out/halfway.db", "../halfway.db", "/etc/passwd"):
        with pytest.raises((UnsafeOutput, OSError)):
            attempt.publish([name])
    assert attempt.store.list("") == []


def test_a_fifo_for_a_log_is_skipped_without_blocking(attempt: JobFiles) -> None:
    os.mkfifo(attempt.scratch / "train.log")
    board = attempt.scratch / "tensorboard"
    board.mkdir()
    os.mkfifo(board / "events.out")
    (board / "linked").symlink_to("/etc/hostname")
    (board / "real.tfevents").write_bytes(b"event")
    shipping = threading.Thread(target=attempt.ship, daemon=True)
    shipping.start()
    shipping.join(10)
    assert not shipping.is_alive(), "shipping blocked on a FIFO"
    assert [e.key for e in attempt.store.list("")] == ["7/tensorboard/real.tfevents"]


def test_a_job_whose_model_links_to_a_server_file_fails_and_stores_nothing_of_it(
    db: Database, settings: Settings
) -> None:
    target = settings.resolved_database_url().removeprefix("sqlite:///")
    job_id = make_job(db, {"mode": "saves_link", "target": target})
    supervisor = Supervisor(db, settings, trainer=fakes.trainer)
    assert supervisor.run_once()
    job = load(db, job_id)
    assert job.status == "failed" and job.error is not None
    assert "refused" in job.error and "model.keras" in job.error
    assert not (settings.resolved_artifact_dir() / str(job_id) / "model.keras").exists()


# --------------------------------------------------------------------------------------------
# Store writes are fenced by the lease


def test_an_attempt_that_lost_its_lease_commits_no_checkpoint(
    db: Database, settings: Settings
) -> None:
    """The attempt's lease is taken over while it trains (its worker was cut off, another
    reclaimed the job); the checkpoint its child writes afterwards must not reach the store,
    where the new owner's attempt would find it."""
    go = "steal-done"
    plan = [{"until": 20, "wait_for": go, "checkpoint_after_wait": 20, "then": "succeed"}]
    job_id = make_job(db, {"mode": "plan", "plan": plan})
    supervisor = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w-orphan")
    outcome: list[Any] = []
    runner = threading.Thread(target=lambda: outcome.append(supervisor.run_once()), daemon=True)
    runner.start()
    wait_for(lambda: step_count(db, job_id) == 20)
    with db.write() as s:  # another worker reclaimed the job
        job = s.get(Job, job_id)
        assert job is not None
        job.worker_id, job.attempt = "w-thief", job.attempt + 1
    (settings.resolved_data_dir() / go).touch()
    runner.join(timeout=60)
    assert outcome == [True]
    store = open_storage(settings.storage_config()).artifacts
    assert checkpoints.committed_steps(store, str(job_id)) == []
    assert store.list(f"{job_id}/checkpoint") == []
    job = load(db, job_id)
    assert job.worker_id == "w-thief" and job.checkpoint_step is None


def test_a_checkpoint_of_an_attempt_holding_its_lease_is_committed_and_acknowledged(
    db: Database, settings: Settings
) -> None:
    """The same plan without the takeover: the checkpoint is in the store and acknowledged,
    so the fence above is what kept it out."""
    go = "go-on"
    (settings.resolved_data_dir() / go).touch()
    plan = [{"until": 20, "wait_for": go, "checkpoint_after_wait": 20, "then": "crash"}]
    # It then crashes: requeued with its checkpoint kept (a job that ends for good has its
    # checkpoints removed).
    job_id = make_job(db, {"mode": "plan", "plan": plan}, max_attempts=2)
    assert Supervisor(db, settings, trainer=fakes.trainer).run_once()
    job = load(db, job_id)
    assert job.status == "queued" and job.checkpoint_step == 20
    store = open_storage(settings.storage_config()).artifacts
    fetched = checkpoints.fetch(store, str(job_id), 20, Path(settings.home) / "check")
    assert fetched is not None and fetched.read_bytes() == b"fake checkpoint of step 20"


# --------------------------------------------------------------------------------------------
# The worker's command line


def _worker(settings: Settings, tmp_path: Path, isolation: str) -> subprocess.Popen[str]:
    """``halfway worker`` on a host without bubblewrap (a PATH that has no bwrap)."""
    empty = tmp_path / "no-bwrap"
    empty.mkdir(exist_ok=True)
    env = {
        "PATH": str(empty),
        "HALFWAY_HOME": str(settings.home),
        "HALFWAY_DATABASE_URL": settings.resolved_database_url(),
        "HALFWAY_CODE_ISOLATION": isolation,
    }
    halfway = Path(sys.executable).parent / "halfway"
    return subprocess.Popen([str(halfway), "worker"], env=env, stderr=subprocess.PIPE, text=True)


def test_a_worker_that_requires_bubblewrap_where_it_cannot_run_refuses_to_start(
    settings: Settings, tmp_path: Path
) -> None:
    worker = _worker(settings, tmp_path, "bubblewrap")
    _, err = worker.communicate(timeout=120)
    assert worker.returncode == 2, err
    assert "HALFWAY_CODE_ISOLATION=bubblewrap, but bwrap is not installed" in err


def test_a_worker_on_auto_where_bubblewrap_cannot_run_starts_and_says_so(
    settings: Settings, tmp_path: Path
) -> None:
    worker = _worker(settings, tmp_path, "auto")
    try:
        assert worker.stderr is not None
        deadline = time.monotonic() + 120
        seen = ""
        while "without isolation" not in seen and time.monotonic() < deadline:
            line = worker.stderr.readline()
            assert line, f"the worker ended: {seen}"
            seen += line
        assert "training children run without isolation: auto, and bwrap is not installed" in seen
    finally:
        worker.terminate()
        worker.wait(timeout=60)


def test_an_attempt_removes_what_earlier_attempts_of_its_job_left_in_scratch(
    settings: Settings, tmp_path: Path
) -> None:
    """A killed worker cannot clean up; the job's next attempt on that host does, and leaves
    other jobs' folders alone."""
    storage = open_storage(settings.storage_config())
    root = tmp_path / "scratch"
    for name in ("5-1", "5-2", "6-1", "55-1"):
        (root / "jobs" / name / "tmp").mkdir(parents=True)
    os.chmod(root / "jobs" / "5-1" / "tmp", 0o500)  # the child may leave it read-only
    files = JobFiles.for_attempt(storage, 5, 3, root)
    assert files.scratch == root / "jobs" / "5-3"
    assert sorted(p.name for p in (root / "jobs").iterdir()) == ["5-3", "55-1", "6-1"]


def test_a_late_starting_earlier_attempt_leaves_the_newer_attempts_folder_alone(
    settings: Settings, tmp_path: Path
) -> None:
    """Hosts that share a scratch disk (Ray nodes on one machine, two supervisors on one
    host): attempt 2's start can come after attempt 3 took the job over (its lease ran out
    while Ray placed it) and began writing. The stale attempt must not remove the live one's
    folder: its child would find its checkpoint's folder gone mid-write."""
    storage = open_storage(settings.storage_config())
    root = tmp_path / "scratch"
    live = JobFiles.for_attempt(storage, 5, 3, root)
    (live.scratch / "checkpoint.npz.part").write_bytes(b"being written")
    stale = JobFiles.for_attempt(storage, 5, 2, root)
    assert (live.scratch / "checkpoint.npz.part").read_bytes() == b"being written"
    assert stale.scratch == root / "jobs" / "5-2"
    # The next attempt on this host removes both.
    JobFiles.for_attempt(storage, 5, 4, root)
    assert sorted(p.name for p in (root / "jobs").iterdir()) == ["5-4"]
