"""Precision sweeps through the API: one job per variant sharing the base's model, data and
seed, 422s that name the variant, and the comparison table built from what the jobs
measured (fake trainers here; tests/test_sweeps_keras.py runs real ones)."""

from __future__ import annotations

from typing import Any

from service.database.db import Database
from service.database.models import Job
from service.settings import Settings
from tests import fakes
from tests.conftest import Api
from workers.supervisor import Supervisor

BASE = {
    "data": {"samples": 512, "features": 16, "classes": 4, "seed": 7},
    "model": {"input_size": 16, "hidden": [8], "num_classes": 4},
    "training": {"epochs": 1, "seed": 3},
}


def test_policies_shorthand_creates_one_job_per_variant_with_the_same_seed_and_data(
    api: Api,
) -> None:
    r = api.post(
        "/v1/sweeps",
        json={
            "name": "which",
            "base": BASE,
            "policies": ["float32", "mixed_float16", "mixed_bfloat16"],
        },
    )
    assert r.status_code == 201, r.text
    sweep = r.json()
    assert [v["policy"] for v in sweep["variants"]] == [
        "float32",
        "mixed_float16",
        "mixed_bfloat16",
    ]
    assert [v["loss_scale_mode"] for v in sweep["variants"]] == ["none", "dynamic", "none"]
    assert sweep["done"] is False
    specs = [api.get(f"/v1/jobs/{v['job_id']}").json()["spec"] for v in sweep["variants"]]
    assert len({str(s["data"]) for s in specs}) == 1
    assert {s["training"]["seed"] for s in specs} == {3}
    assert [s["name"] for s in specs] == [
        "which/float32",
        "which/mixed_float16",
        "which/mixed_bfloat16",
    ]
    assert all(
        api.get(f"/v1/jobs/{v['job_id']}").json()["sweep_id"] == sweep["id"]
        for v in sweep["variants"]
    )


def test_loss_scale_variants(api: Api) -> None:
    r = api.post(
        "/v1/sweeps",
        json={
            "base": BASE,
            "variants": [
                {"name": "dyn", "loss_scale": {"mode": "dynamic"}},
                {"name": "fixed-1024", "loss_scale": {"mode": "fixed", "initial_scale": 1024}},
                {"name": "hyst", "loss_scale": {"hysteresis": 2, "growth_steps": 100}},
            ],
            "target_loss": 0.5,
        },
    )
    assert r.status_code == 201, r.text
    jobs = [api.get(f"/v1/jobs/{v['job_id']}").json() for v in r.json()["variants"]]
    assert [j["spec"]["loss_scale"]["mode"] for j in jobs] == ["dynamic", "fixed", "dynamic"]
    assert jobs[1]["spec"]["loss_scale"]["initial_scale"] == 1024
    assert all(j["spec"]["training"]["target_loss"] == 0.5 for j in jobs)


def test_bad_variant_is_422_naming_it_and_creates_nothing(api: Api) -> None:
    r = api.post(
        "/v1/sweeps",
        json={
            "base": BASE,
            "variants": [
                {"precision": {"policy": "float32"}},
                {
                    "precision": {
                        "policy": {"variable_dtype": "float16", "compute_dtype": "float32"}
                    }
                },
            ],
        },
    )
    assert r.status_code == 422
    assert r.json()["fields"][0]["field"] == "variants.1.precision.policy"
    assert api.get("/v1/jobs").json()["items"] == []
    bad_base = api.post("/v1/sweeps", json={"base": {"epochs": 3}, "policies": ["float32"]})
    assert bad_base.status_code == 422 and bad_base.json()["fields"][0]["field"] == "base.epochs"
    assert api.post("/v1/sweeps", json={"base": BASE}).status_code == 422  # no variants
    mismatch = api.post(
        "/v1/sweeps",
        json={
            "base": {**BASE, "model": {"input_size": 99, "num_classes": 4}},
            "policies": ["float32"],
        },
    )
    assert mismatch.status_code == 422
    assert mismatch.json()["fields"][0]["field"] == "variants.0.model.input_size"


def test_comparison_reports_what_each_job_measured(
    api: Api, db: Database, settings: Settings
) -> None:
    sweep = api.post(
        "/v1/sweeps", json={"base": BASE, "policies": ["float32", "mixed_float16"]}
    ).json()
    timings: dict[str, dict[str, Any]] = {
        "float32": {
            "median_step_seconds": 0.02,
            "examples_per_second": 1600.0,
            "time_to_target_seconds": 3.0,
            "step_to_target": 150,
        },
        "mixed_float16": {
            "median_step_seconds": 0.01,
            "examples_per_second": 3200.0,
            "peak_memory_bytes": 1234.0,
        },
    }
    with db.write() as s:
        for v in sweep["variants"]:
            job = s.get(Job, v["job_id"])
            assert job is not None
            job.spec = {**job.spec, "fake": {"steps": 12, "timing": timings[v["policy"]]}}
    sup = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    while sup.run_once():
        pass
    table = api.get(f"/v1/sweeps/{sweep['id']}").json()
    assert table["done"] is True
    f32, f16 = table["variants"]
    assert f32["median_step_seconds"] == 0.02 and f16["median_step_seconds"] == 0.01
    assert f32["speedup_vs_float32"] == 1.0 and f16["speedup_vs_float32"] == 2.0
    assert f32["time_to_target_seconds"] == 3.0 and f32["step_to_target"] == 150
    assert f16["peak_memory_bytes"] == 1234.0 and f32["peak_memory_bytes"] is None
    assert f32["final_loss"] == 0.5 and f32["final_metrics"] == {"loss": 0.5}
    assert f16["final_loss_scale"] == 1024.0 and f16["min_loss_scale"] == 1024.0
    assert f16["skipped_steps"] == f16["overflow_count"] == 0


def test_unknown_sweep_is_404(api: Api) -> None:
    assert api.get("/v1/sweeps/9999").status_code == 404


def test_an_auto_variant_is_compared_by_what_it_chose_with_its_shadow_figures(
    api: Api, db: Database, settings: Settings
) -> None:
    sweep = api.post(
        "/v1/sweeps",
        json={
            "base": BASE,
            "variants": [
                {"name": "f32", "precision": {"policy": "float32"}},
                {"name": "auto", "precision": {"policy": "auto"}},
            ],
        },
    ).json()
    with db.write() as s:
        for v in sweep["variants"]:
            job = s.get(Job, v["job_id"])
            assert job is not None
            fake = {"steps": 12, "batch": 4, "gradients_every": 4, "shadow_every": 8}
            if v["policy"] == "auto":
                fake["decision"] = True
            job.spec = {**job.spec, "fake": fake}
    sup = Supervisor(db, settings, trainer=fakes.trainer, worker_id="w")
    while sup.run_once():
        pass
    f32, auto = api.get(f"/v1/sweeps/{sweep['id']}").json()["variants"]
    chosen = api.get(f"/v1/jobs/{auto['job_id']}").json()
    assert auto["policy"] == chosen["precision_decision"]["policy"] == "mixed_float16"
    assert auto["loss_scale_mode"] == "dynamic"  # 'auto' resolved for float16 compute
    shadow = chosen["gradients"]["latest_shadow"]
    assert shadow["step"] == 8
    assert auto["underflow_share"] == shadow["underflow_share"] is not None
    assert auto["lost_share"] == shadow["lost_share"] is not None
    assert f32["policy"] == "float32" and f32["loss_scale_mode"] == "none"
