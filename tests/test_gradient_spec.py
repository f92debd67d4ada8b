"""The spec for issue #24: the `gradients` section (the gradient meter), precision.policy 'auto'
with its `probe` settings, and the one rule for what loss_scale.mode 'auto' means. Through the
real API's dry run, which validates and normalizes but never probes."""

from __future__ import annotations

from typing import Any

import pytest

from service.specs.policies import POLICIES, loss_scale_mode_for
from tests.conftest import Api

GRADIENT_DEFAULTS = {
    "every": 250,
    "shadow_every": 1000,
    "alarm_share": 0.05,
    "alarm_samples": 3,
    "guard": False,
}
PROBE_DEFAULTS = {
    "steps": 20,
    "warmup": 5,
    "loss_tolerance": 0.05,
    "max_lost_share": 0.01,
    "min_speedup": 1.05,
}


def _dry_run(api: Api, spec: dict[str, Any]) -> dict[str, Any]:
    r = api.post("/v1/jobs?dry_run=true", json=spec)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _refused(api: Api, spec: dict[str, Any]) -> list[tuple[str, str]]:
    r = api.post("/v1/jobs?dry_run=true", json=spec)
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "validation_error"
    assert all(f["message"] for f in body["fields"])
    return [(f["field"], f["rule"]) for f in body["fields"]]


def test_an_empty_spec_gets_the_meter_and_probe_defaults(api: Api) -> None:
    spec = _dry_run(api, {})["spec"]
    assert spec["gradients"] == GRADIENT_DEFAULTS
    assert spec["precision"]["probe"] == PROBE_DEFAULTS


def test_gradient_settings_are_kept_as_given(api: Api) -> None:
    given = {"every": 10, "shadow_every": 0, "alarm_share": None, "alarm_samples": 7, "guard": True}
    assert _dry_run(api, {"gradients": given})["spec"]["gradients"] == given


def test_every_zero_turns_the_meter_off_and_is_accepted(api: Api) -> None:
    spec = _dry_run(api, {"gradients": {"every": 0, "shadow_every": 0}})["spec"]
    assert spec["gradients"]["every"] == 0 and spec["gradients"]["shadow_every"] == 0


OUT_OF_BOUNDS: list[tuple[str, dict[str, Any], str, str]] = [
    ("negative every", {"gradients": {"every": -1}}, "gradients.every", "greater_than_equal"),
    ("huge every", {"gradients": {"every": 10**9 + 1}}, "gradients.every", "less_than_equal"),
    (
        "negative shadow_every",
        {"gradients": {"shadow_every": -5}},
        "gradients.shadow_every",
        "greater_than_equal",
    ),
    (
        "huge shadow_every",
        {"gradients": {"shadow_every": 10**10}},
        "gradients.shadow_every",
        "less_than_equal",
    ),
    (
        "fractional every",
        {"gradients": {"every": 2.5}},
        "gradients.every",
        "int_type",
    ),
    ("alarm_share 0", {"gradients": {"alarm_share": 0}}, "gradients.alarm_share", "greater_than"),
    (
        "alarm_share above 1",
        {"gradients": {"alarm_share": 1.5}},
        "gradients.alarm_share",
        "less_than_equal",
    ),
    (
        "alarm_samples 0",
        {"gradients": {"alarm_samples": 0}},
        "gradients.alarm_samples",
        "greater_than_equal",
    ),
    (
        "alarm_samples huge",
        {"gradients": {"alarm_samples": 10**6 + 1}},
        "gradients.alarm_samples",
        "less_than_equal",
    ),
    ("guard as 1", {"gradients": {"guard": 1}}, "gradients.guard", "bool_type"),
    ("unknown meter field", {"gradients": {"often": 3}}, "gradients.often", "extra_forbidden"),
    (
        "probe steps 1",
        {"precision": {"policy": "auto", "probe": {"steps": 1}}},
        "precision.probe.steps",
        "greater_than_equal",
    ),
    (
        "probe steps 1001",
        {"precision": {"probe": {"steps": 1001}}},
        "precision.probe.steps",
        "less_than_equal",
    ),
    (
        "probe warmup 0",
        {"precision": {"policy": "auto", "probe": {"warmup": 0}}},
        "precision.probe.warmup",
        "greater_than_equal",
    ),
    (
        "probe warmup 1001",
        {"precision": {"probe": {"warmup": 1001}}},
        "precision.probe.warmup",
        "less_than_equal",
    ),
    (
        "loss_tolerance 0",
        {"precision": {"policy": "auto", "probe": {"loss_tolerance": 0}}},
        "precision.probe.loss_tolerance",
        "greater_than",
    ),
    (
        "loss_tolerance 11",
        {"precision": {"probe": {"loss_tolerance": 11}}},
        "precision.probe.loss_tolerance",
        "less_than_equal",
    ),
    (
        "negative max_lost_share",
        {"precision": {"probe": {"max_lost_share": -0.1}}},
        "precision.probe.max_lost_share",
        "greater_than_equal",
    ),
    (
        "max_lost_share above 1",
        {"precision": {"probe": {"max_lost_share": 1.01}}},
        "precision.probe.max_lost_share",
        "less_than_equal",
    ),
    (
        "min_speedup below 1",
        {"precision": {"policy": "auto", "probe": {"min_speedup": 0.9}}},
        "precision.probe.min_speedup",
        "greater_than_equal",
    ),
    (
        "min_speedup 101",
        {"precision": {"probe": {"min_speedup": 101}}},
        "precision.probe.min_speedup",
        "less_than_equal",
    ),
    (
        "unknown probe field",
        {"precision": {"probe": {"candidates": ["float32"]}}},
        "precision.probe.candidates",
        "extra_forbidden",
    ),
    (
        "auto with the grappler rewrite",
        {"precision": {"policy": "auto", "graph_rewrite": True}},
        "precision",
        "graph_rewrite_conflict",
    ),
    (
        "a misspelt auto",
        {"precision": {"policy": "Auto"}},
        "precision.policy",
        "literal_error",
    ),
]


@pytest.mark.parametrize(
    ("case", "spec", "field", "rule"), OUT_OF_BOUNDS, ids=[c[0] for c in OUT_OF_BOUNDS]
)
def test_a_setting_out_of_bounds_is_a_422_naming_the_field_and_rule(
    api: Api, case: str, spec: dict[str, Any], field: str, rule: str
) -> None:
    assert (field, rule) in _refused(api, spec)


def test_the_bounds_themselves_are_accepted(api: Api) -> None:
    edges = {
        "gradients": {"every": 10**9, "shadow_every": 10**9, "alarm_share": 1, "alarm_samples": 1},
        "precision": {
            "policy": "auto",
            "probe": {
                "steps": 2,
                "warmup": 1000,
                "loss_tolerance": 10,
                "max_lost_share": 0,
                "min_speedup": 1,
            },
        },
    }
    spec = _dry_run(api, edges)["spec"]
    assert spec["gradients"]["alarm_share"] == 1.0
    assert spec["precision"]["probe"]["min_speedup"] == 1.0


def test_auto_with_graph_rewrite_says_why(api: Api) -> None:
    r = api.post(
        "/v1/jobs?dry_run=true", json={"precision": {"policy": "auto", "graph_rewrite": True}}
    )
    message = r.json()["fields"][0]["message"]
    assert "'auto'" in message and "graph_rewrite" in message and "float32" in message


def test_auto_keeps_the_policy_and_the_scaling_mode_for_the_child_to_resolve(api: Api) -> None:
    spec = _dry_run(api, {"precision": {"policy": "auto"}})["spec"]
    assert spec["precision"]["policy"] == "auto"
    assert spec["loss_scale"]["mode"] == "auto"


def test_auto_keeps_an_explicit_scaling_mode(api: Api) -> None:
    spec = _dry_run(
        api, {"precision": {"policy": "auto"}, "loss_scale": {"mode": "fixed", "initial_scale": 1}}
    )["spec"]
    assert spec["loss_scale"]["mode"] == "fixed"
    assert spec["loss_scale"]["initial_scale"] == 1.0


def test_auto_names_the_job_after_the_model_kind(api: Api) -> None:
    assert _dry_run(api, {"precision": {"policy": "auto"}})["spec"]["name"] == "mlp-auto"
    assert _dry_run(api, {"precision": {"policy": "auto"}, "name": "mine"})["spec"]["name"] == (
        "mine"
    )


def test_auto_explains_the_probes_and_the_rule_in_a_note(api: Api) -> None:
    body = _dry_run(
        api,
        {"precision": {"policy": "auto", "probe": {"steps": 30, "warmup": 4, "min_speedup": 1.2}}},
    )
    note = next(n for n in body["notes"] if n.startswith("policy 'auto'"))
    for candidate in ("float32", "mixed_bfloat16", "mixed_float16"):
        assert candidate in note
    assert "4 + 30 steps each" in note
    assert "1.2x as fast" in note
    assert "not part of the step history" in note
    assert "'dynamic' if mixed_float16 is chosen" in note


def test_auto_gets_no_warnings_that_need_a_concrete_policy(api: Api) -> None:
    # 'none' with float16 compute warns for mixed_float16; under auto it is the user's
    # choice for every candidate, and which policy runs is not known yet.
    body = _dry_run(api, {"precision": {"policy": "auto"}, "loss_scale": {"mode": "none"}})
    assert body["warnings"] == []
    assert not any("loss_scale.mode 'auto' is" in n for n in body["notes"])


def test_a_submitted_auto_job_stores_auto(api: Api) -> None:
    r = api.post("/v1/jobs", json={"precision": {"policy": "auto"}})
    assert r.status_code == 201, r.text
    stored = api.get(f"/v1/jobs/{r.json()['id']}").json()["spec"]
    assert stored["precision"]["policy"] == "auto"
    assert stored["loss_scale"]["mode"] == "auto"
    assert stored["gradients"] == GRADIENT_DEFAULTS


def test_a_concrete_policy_still_resolves_the_scaling_mode(api: Api) -> None:
    spec = _dry_run(api, {"precision": {"policy": "mixed_bfloat16"}})["spec"]
    assert spec["loss_scale"]["mode"] == "none"
    assert spec["name"] == "mlp-mixed_bfloat16"


def test_the_json_schema_offers_auto(api: Api) -> None:
    document = api.get("/openapi.json").json()
    policy = document["components"]["schemas"]["PrecisionSpec"]["properties"]["policy"]
    names = next(option["enum"] for option in policy["anyOf"] if option.get("type") == "string")
    assert "auto" in names and "mixed_float16" in names


@pytest.mark.parametrize(
    ("mode", "compute", "expected"),
    [
        ("auto", "float16", "dynamic"),
        ("auto", "bfloat16", "none"),
        ("auto", "float32", "none"),
        ("auto", "float64", "none"),
        ("dynamic", "float32", "dynamic"),
        ("fixed", "bfloat16", "fixed"),
        ("fixed", "float16", "fixed"),
        ("none", "float16", "none"),
    ],
)
def test_loss_scale_mode_for(mode: str, compute: str, expected: str) -> None:
    assert loss_scale_mode_for(mode, compute) == expected


def test_loss_scale_mode_for_agrees_with_each_policys_advice() -> None:
    for facts in POLICIES.values():
        scaled = loss_scale_mode_for("auto", facts.compute_dtype) == "dynamic"
        assert scaled == facts.loss_scaling_advised, facts.name


def test_loss_scale_mode_for_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="static"):
        loss_scale_mode_for("static", "float16")
