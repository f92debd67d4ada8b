"""The spec's guards: a run that loss scaling cannot save fails with a reason a person can act
on; a high overflow rate raises a warning that clears when the rate falls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.specs.schemas import GuardsSpec
from tests.training_runs import job_spec, run_job
from workers.guards import Guards
from workers.recording import Drained

pytestmark = pytest.mark.keras


def config(**overrides: Any) -> dict[str, Any]:
    """The schema's defaults with ``overrides``, as the child receives them."""
    cfg: dict[str, Any] = GuardsSpec().model_dump(mode="json")
    cfg.update(overrides)
    return cfg


def records(
    first: int, pattern: str, *, scale: float | list[float] = 1024.0, loss: float = 0.5
) -> Drained:
    """One record per character: ``.`` finite gradients, ``i`` non-finite."""
    n = len(pattern)
    scales = np.broadcast_to(np.asarray(scale, np.float32), (n,)).copy()
    return Drained(
        first,
        np.full(n, loss, np.float32),
        scales,
        np.array([c == "." for c in pattern], bool),
    )


def feed(guards: Guards, *patterns: str, **kwargs: Any) -> list[str | None]:
    """Check consecutive drains, numbering the steps on from 0; one result per drain."""
    results, first = [], 0
    for pattern in patterns:
        results.append(guards.check(first, records(first, pattern, **kwargs)))
        first += len(pattern)
    return results


def test_consecutive_non_finite_steps_fail_at_the_limit_even_across_drains() -> None:
    guards = Guards(config(max_consecutive_nonfinite=3), min_scale=None)
    results = feed(guards, ".ii.", "ii.i", "ii")
    assert results[:2] == [None, None]  # runs of two, each broken by a finite step
    reason = results[2]
    assert reason is not None
    assert reason.startswith("guard: 3 steps in a row had non-finite gradients")
    assert "up to step 9" in reason and "loss scale is 1024" in reason


def test_a_clean_drain_breaks_the_non_finite_and_min_scale_runs() -> None:
    # An all-clear drain is handled in bulk; it must reset the runs like a step-by-step one.
    guards = Guards(config(max_consecutive_nonfinite=3, max_steps_at_min_scale=3), min_scale=1.0)
    assert guards.check(0, records(0, "ii", scale=1.0)) is None
    assert guards.check(2, records(2, "....", scale=2.0)) is None
    assert guards.check(6, records(6, "ii", scale=1.0)) is None
    assert (guards.nonfinite_run, guards.min_scale_run) == (2, 2)
    assert list(guards.window) == [True] * 2 + [False] * 4 + [True] * 2


def test_consecutive_non_finite_guard_switched_off_never_fails() -> None:
    guards = Guards(config(max_consecutive_nonfinite=None), min_scale=None)
    assert feed(guards, "i" * 500) == [None]


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_loss_with_finite_gradients_fails_as_divergence(bad: float) -> None:
    guards = Guards(config(), min_scale=None)
    assert guards.check(0, records(0, "...")) is None
    reason = guards.check(3, records(3, ".", loss=bad))
    assert reason is not None
    assert "at step 3 although every gradient was finite" in reason


def test_non_finite_loss_with_non_finite_gradients_is_left_to_the_scaler() -> None:
    guards = Guards(config(), min_scale=None)
    assert guards.check(0, records(0, "i", loss=np.inf)) is None


def test_non_finite_loss_guard_switched_off_never_fails() -> None:
    guards = Guards(config(fail_on_nonfinite_loss=False), min_scale=None)
    assert guards.check(0, records(0, "....", loss=np.nan)) is None


def test_scale_sitting_at_min_scale_fails_after_the_limit_and_a_rise_resets_the_count() -> None:
    guards = Guards(config(max_steps_at_min_scale=4), min_scale=1.0)
    at_floor = [1.0, 1.0, 1.0, 2.0, 1.0, 1.0]  # three, then a rise
    assert guards.check(0, records(0, "......", scale=at_floor)) is None
    reason = guards.check(6, records(6, "...", scale=1.0))
    assert reason is not None  # 2 + 3 more: the fourth lands on step 7
    assert "sat at its floor min_scale=1 for 4 steps (up to step 7)" in reason


def test_min_scale_guard_sees_a_floor_that_float32_cannot_represent() -> None:
    # The scaler clamps in float32, so the recorded scale is float32(0.3), a hair above 0.3.
    guards = Guards(config(max_steps_at_min_scale=3), min_scale=0.3)
    reason = guards.check(0, records(0, "iii", scale=float(np.float32(0.3))))
    assert reason is not None and "min_scale=0.3 for 3 steps" in reason


@pytest.mark.parametrize(
    ("cfg", "min_scale"),
    [(config(max_steps_at_min_scale=None), 1.0), (config(max_steps_at_min_scale=2), None)],
    ids=["guard_off", "not_dynamic"],
)
def test_min_scale_guard_off_or_without_dynamic_scaling_never_fails(
    cfg: dict[str, Any], min_scale: float | None
) -> None:
    guards = Guards(cfg, min_scale=min_scale)
    assert feed(guards, "." * 50, scale=1.0) == [None]


def test_overflow_rate_warning_appears_above_the_threshold_and_clears_below() -> None:
    guards = Guards(config(overflow_window=20, overflow_warn_rate=0.1), min_scale=None)
    feed(guards, "iii......")
    assert guards.warning is None  # fewer than 10 steps: too few to judge
    guards.check(9, records(9, "..........."))
    assert guards.warning == "overflow rate 15.0% over the last 20 steps (warn above 10.0%)"
    guards.check(20, records(20, "."))  # one overflow leaves the window: 2 of 20 is not above
    assert guards.warning is None
    guards.check(21, records(21, "iii"))
    assert guards.warning is not None and guards.warning.startswith("overflow rate 15.0%")
    guards.check(24, records(24, "." * 20))
    assert guards.warning is None


def test_overflow_rate_warning_switched_off_never_warns() -> None:
    guards = Guards(config(overflow_window=10, overflow_warn_rate=None), min_scale=None)
    feed(guards, "i" * 30)
    assert guards.warning is None


# Through train(): the guard's reason is the job's error.


def test_job_fails_with_the_reason_after_consecutive_non_finite_steps(tmp_path: Path) -> None:
    spec = job_spec(
        tmp_path,
        faults={"nonfinite_at_steps": [5, 6, 7, 8]},
        guards={"max_consecutive_nonfinite": 3},
    )
    run = run_job(spec, tmp_path / "job")
    assert run.status is None
    assert run.error is not None
    assert run.error.startswith(
        "guard: 3 steps in a row had non-finite gradients (updates skipped) up to step 7"
    )
    # The records up to the failure reached the supervisor before the error.
    assert run.steps == list(range(len(run.steps))) and run.steps[-1] >= 7


def test_job_fails_when_the_scale_sits_at_min_scale(tmp_path: Path) -> None:
    spec = job_spec(
        tmp_path,
        loss_scale={"initial_scale": 4},
        faults={"nonfinite_at_steps": [0, 1, 2]},
        guards={"max_steps_at_min_scale": 10},
    )
    run = run_job(spec, tmp_path / "job")
    assert run.error is not None
    # Scales 4, 2, then 1 from step 2 on: the tenth step at the floor is step 11.
    assert [r[3] for r in run.records[:4]] == [4.0, 2.0, 1.0, 1.0]
    assert "sat at its floor min_scale=1 for 10 steps (up to step 11)" in run.error


def test_job_with_guards_off_rides_out_what_would_trip_them(tmp_path: Path) -> None:
    faults = list(range(3, 20))
    spec = job_spec(
        tmp_path,
        loss_scale={"initial_scale": 4},
        faults={"nonfinite_at_steps": faults},
        guards={
            "max_consecutive_nonfinite": None,
            "max_steps_at_min_scale": None,
            "fail_on_nonfinite_loss": False,
        },
    )
    run = run_job(spec, tmp_path / "job")
    assert run.status == "succeeded", run.error
    assert [s for s, *_, ok in run.records if not ok] == faults
    assert all(r[3] == 1.0 for r in run.records[5:])  # and the scale sat at its floor


def test_job_warns_about_the_overflow_rate_and_clears_the_warning(tmp_path: Path) -> None:
    spec = job_spec(
        tmp_path,
        faults={"nonfinite_at_steps": [6, 7]},
        guards={"overflow_window": 10, "overflow_warn_rate": 0.1},
    )
    run = run_job(spec, tmp_path / "job")
    assert run.status == "succeeded", run.error
    warnings = [m["message"] for m in run.of_type("warning")]  # type: ignore[typeddict-item]
    # Judged once per execution of 5 steps: at step 9 two of the last 10 overflowed; by
    # step 19 both have left the window.
    assert warnings == ["overflow rate 20.0% over the last 10 steps (warn above 10.0%)", None]
