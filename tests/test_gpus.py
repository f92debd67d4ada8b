"""GPU slots without a GPU: parsing --gpus, splitting slots, which GPUs a job gets, the wait
for a slot's memory to be free, and the environment the training child starts with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.database.db import Database
from service.database.models import Job
from service.settings import Settings
from tests import fakes
from tests.test_supervisor import load, make_job
from workers import gpus
from workers.sandbox import child_env
from workers.supervisor import Supervisor


def test_parse_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpus.parse_gpus(None) == [] and gpus.parse_gpus("") == []
    assert gpus.parse_gpus("0, 2,3") == [0, 2, 3]
    monkeypatch.setattr(gpus, "detect_gpus", lambda: [0, 1, 2, 3])
    assert gpus.parse_gpus("all") == [0, 1, 2, 3]
    monkeypatch.setattr(gpus, "detect_gpus", lambda: [])
    with pytest.raises(ValueError, match="found no GPUs"):
        gpus.parse_gpus("all")
    with pytest.raises(ValueError, match="not a GPU index"):
        gpus.parse_gpus("0,x")
    with pytest.raises(ValueError, match="twice"):
        gpus.parse_gpus("1,1")


def test_slots() -> None:
    assert gpus.slots([], 1) == [[]]  # a CPU worker is one slot
    assert gpus.slots([0, 1, 2, 3], 1) == [[0], [1], [2], [3]]
    assert gpus.slots([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="do not split"):
        gpus.slots([0, 1, 2], 2)


def test_child_environment_shows_only_its_gpus() -> None:
    home = Path("/job")
    assert (
        child_env({"CUDA_VISIBLE_DEVICES": "0,1"}, home=home, gpu_ids=[])["CUDA_VISIBLE_DEVICES"]
        == "-1"
    )
    env = child_env({}, home=home, gpu_ids=[2, 3])
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"


def test_wait_until_free_polls_until_the_memory_is_released() -> None:
    readings = iter([{0: 9000}, {0: 4000}, {0: 100}])
    slept: list[float] = []
    assert gpus.wait_until_free(
        [0], threshold_mib=512, timeout=10, probe=lambda ids: next(readings), sleep=slept.append
    )
    assert len(slept) == 2
    assert not gpus.wait_until_free(
        [0], threshold_mib=512, timeout=1, probe=lambda ids: {0: 9000}, sleep=lambda s: None
    )
    # Nothing to measure (no nvidia-smi, a CPU slot): do not block.
    assert gpus.wait_until_free([0], threshold_mib=0, timeout=0, probe=lambda ids: None)
    assert gpus.wait_until_free([], threshold_mib=0, timeout=0, probe=lambda ids: {0: 1})


def test_supervisor_does_not_claim_while_its_gpus_hold_memory(
    db: Database, settings: Settings
) -> None:
    settings.gpu_free_timeout_seconds = 0
    busy = {"mib": 20_000}

    def probe(ids: list[int]) -> dict[int, int]:
        return {i: busy["mib"] for i in ids}

    sup = Supervisor(db, settings, trainer=fakes.trainer, gpu_ids=[0], memory_probe=probe)
    job_id = make_job(db, {"steps": 3})
    assert sup.run_once() is False
    assert load(db, job_id).status == "queued"
    busy["mib"] = 0
    assert sup.run_once() is True
    assert load(db, job_id).status == "succeeded"


@pytest.mark.parametrize(
    ("held", "wanted", "given"),
    [
        ([], "auto", []),
        ([3], "auto", [3]),
        ([1, 2], 0, []),
        ([1, 2], 2, [1, 2]),
        ([5, 6], "auto", [5]),
    ],
)
def test_a_job_gets_the_gpus_it_asks_for_from_its_slot(
    db: Database, settings: Settings, held: list[int], wanted: Any, given: list[int]
) -> None:
    sup = Supervisor(
        db, settings, trainer=fakes.trainer, gpu_ids=held, memory_probe=lambda ids: None
    )
    job_id = make_job(db, {"steps": 2}, resources={"gpus": wanted})
    assert sup.run_once()
    with db.read() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.status == "succeeded"
        assert job.device["gpu_ids"] == given


def test_device_warnings_reach_the_job(db: Database, settings: Settings) -> None:
    sup = Supervisor(db, settings, trainer=fakes.trainer)
    job_id = make_job(db, {"steps": 2, "device_warnings": ["GPU 0 has compute capability 6.1"]})
    sup.run_once()
    assert "GPU 0 has compute capability 6.1" in load(db, job_id).warnings
