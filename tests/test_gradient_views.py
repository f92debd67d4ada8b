"""A job's gradient samples and precision decision as the Python client and the ``halfway``
commands show them: ``Client.gradients`` (the long table, via Parquet), ``halfway show``
(the latest sample, the latest shadow sample, the decision with its probes) and ``halfway
gradients`` (the sampled steps, each variable at one sample). Against a live server (SQLite,
and PostgreSQL when HALFWAY_TEST_DATABASE_URL is set) whose worker runs the fake trainer of
``tests/fakes.py``, which sends known samples and a known decision without TensorFlow."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from service.client import Client, ExitCode, NotFound
from service.client.frames import GRADIENT_COLUMNS
from service.client.gradient_tables import fmt_headroom, fmt_log2, fmt_share
from service.database.db import Database
from service.settings import Settings
from service.specs.schemas import GradientsSpec
from tests import fakes
from tests.live import Live, halfway
from tests.test_client_cli import TINY, cli, find_row, table_line, table_row
from tests.test_supervisor import make_job
from tests.waiting import eventually
from workers.supervisor import Supervisor

# Samples at steps 0, 3, 6 and 9 (every 3 of 12 steps, sent in batches of 4), the float32
# shadow at 0 and 6; the figures of each are fakes.fake_sample's.
SAMPLED = {
    "mode": "succeed",
    "steps": 12,
    "batch": 4,
    "gradients_every": 3,
    "shadow_every": 6,
    "decision": True,
}


@contextmanager
def fake_worker(db: Database, settings: Settings) -> Iterator[Supervisor]:
    """A real supervisor whose training children are the fake trainer (spawned processes)."""
    supervisor = Supervisor(db, settings, trainer=fakes.trainer, worker_id="fake-worker")
    thread = threading.Thread(target=supervisor.run_forever, daemon=True)
    thread.start()
    try:
        yield supervisor
    finally:
        supervisor.stop()
        thread.join(30)


def run_fake(live: Live, fake: dict[str, Any], **spec: Any) -> int:
    """A job trained to its end by the fake trainer; its id once the API says it succeeded."""
    job_id = make_job(live.db, fake, name="sampled", **spec)
    with fake_worker(live.db, live.settings):
        eventually(
            lambda: live.api("GET", f"/v1/jobs/{job_id}"),
            lambda job: job["status"] == "succeeded" and job["gradients"] is not None,
            timeout=60,
        )
    return job_id


@pytest.fixture
def sampled(live: Live) -> int:
    return run_fake(live, SAMPLED)


# --------------------------------------------------------------------------------------------
# Formatting for people


def test_shares_are_percentages_that_never_round_a_loss_away() -> None:
    assert [fmt_share(v) for v in (0.0, 1.0, 0.125, 0.0078125, 0.03125, None)] == [
        "0%",
        "100%",
        "12.5%",
        "0.781%",
        "3.13%",  # half away from zero, as the dashboard rounds
        "-",
    ]
    # A share that is not exactly 0 or 1 never prints as one.
    assert fmt_share(1e-9) == "<0.01%"
    assert fmt_share(1 - 1e-9) == ">99.99%"


def test_magnitudes_are_powers_of_two_and_headroom_is_in_doublings() -> None:
    # Halves round away from zero, as the dashboard's JavaScript rounds: both print the same.
    assert [fmt_log2(v) for v in (-24.0, -3.25, -0.04, 15.0, None)] == [
        "2^-24",
        "2^-3.3",
        "2^0",
        "2^15",
        "-",
    ]
    assert [fmt_headroom(v) for v in (17.25, 1.0, -0.5, None)] == [
        "17.3 doublings",
        "1.0 doubling",
        "-0.5 doublings",
        "-",
    ]


# --------------------------------------------------------------------------------------------
# Client.gradients


def test_client_gradients_is_the_long_table_one_row_per_sample_and_variable(
    live: Live, sampled: int
) -> None:
    with Client(live.url, live.team.alice, env={}) as hw:
        frame = hw.gradients(sampled)
        page = hw.gradient_page(sampled)
    assert list(frame.columns) == list(GRADIENT_COLUMNS)
    assert str(frame["step"].dtype) == "int64"
    assert {str(frame[c].dtype) for c in ("shadow", "finite")} == {"bool"}
    assert {str(frame[c].dtype) for c in GRADIENT_COLUMNS[5:]} == {"float64"}
    # Each sampled step: the whole model's row first, then each variable's.
    assert list(zip(frame["step"], frame["variable"], strict=True)) == [
        (step, name) for step in (0, 3, 6, 9) for name in ("(model)", "dense/kernel", "dense/bias")
    ]
    model = frame[frame["variable"] == "(model)"].reset_index(drop=True)
    assert model["shadow"].tolist() == [True, False, True, False]
    assert model["log2_max"].tolist() == [-2.0, -5.0, -3.0, -6.0]
    assert model["headroom"].tolist() == [17.75, 20.75, 18.75, 21.75]
    assert model["loss_scale"].tolist() == [1024.0] * 4
    # The shadow's figures where it ran, NaN elsewhere (null in the API).
    assert model["underflow_share"].tolist()[::2] == [0.03125, 0.03125]
    assert all(math.isnan(v) for v in model["lost_share"].tolist()[1::2])
    bias = frame[frame["variable"] == "dense/bias"]
    assert bias["zero_share"].tolist() == [0.25] * 4
    assert bias["log2_min_nonzero"].tolist() == [-31.0, -31.0, -31.0, -31.0]
    # The same figures as the JSON pages.
    for sample, row in zip(page["samples"], model.to_dict("records"), strict=True):
        for name in GRADIENT_COLUMNS[5:]:
            expected = sample[name]
            assert (math.isnan(row[name]) and expected is None) or row[name] == expected, name


def test_client_gradients_of_a_job_without_samples_is_empty_with_every_column(
    live: Live,
) -> None:
    job_id = live.submit(TINY)
    with Client(live.url, live.team.alice, env={}) as hw:
        frame = hw.gradients(job_id)
        assert frame.empty and list(frame.columns) == list(GRADIENT_COLUMNS)
        assert str(frame["headroom"].dtype) == "float64"
        with pytest.raises(NotFound):
            hw.gradients(job_id + 100)


# --------------------------------------------------------------------------------------------
# halfway show


def test_show_prints_the_latest_sample_the_latest_shadow_and_the_decision_with_its_probes(
    live: Live, sampled: int
) -> None:
    result = cli(live, "show", str(sampled))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert table_line(out, "gradients") == (
        "step 9 at loss scale 1024, max |G| 2^-6 (headroom 21.8 doublings), smallest nonzero "
        "2^-30, zero 0.781%, subnormal 12.5%"
    )
    assert table_line(out, "float32 shadow") == (
        "step 6 at loss scale 1024: underflow 3.13%, lost 1.56%, relative error 0.000977"
    )
    assert table_line(out, "precision decision") == (
        "mixed_float16: fake: the fastest candidate whose loss tracks float32's"
    )
    assert "Precision probes (policy auto chose mixed_float16)" in out
    assert table_row(out, "float32") == [
        "",
        "float32",
        "4.00",
        "0.5",
        "0",
        "0/20",
        "0%",
        "0%",
        "yes",
        "within tolerance",
    ]
    assert table_row(out, "mixed_bfloat16")[2:5] == ["3.00", "0.5", "0.01"]
    # The chosen policy's row is starred.
    assert table_row(out, "*")[:5] == ["*", "mixed_float16", "2.00", "0.5", "0.001"]


def test_show_of_a_job_without_samples_or_decision_prints_neither(live: Live) -> None:
    job_id = live.submit(TINY)
    out = cli(live, "show", str(job_id)).stdout
    assert "float32 shadow" not in out and "Precision probes" not in out
    assert not any(line.strip().startswith("gradients ") for line in out.splitlines()), out


# --------------------------------------------------------------------------------------------
# halfway gradients


def test_gradients_prints_each_sampled_step_at_model_level_page_by_page(
    live: Live, sampled: int
) -> None:
    first = cli(live, "gradients", str(sampled), "--limit", "2")
    assert first.exit_code == 0, first.output
    assert f"Job {sampled} gradient samples (succeeded)" in first.stdout
    assert table_row(first.stdout, "0") == [
        "0",
        "1024",
        "0.781%",
        "2^-2",
        "2^-30",
        "17.8 doublings",
        "12.5%",
        "3.13%",
        "1.56%",
        "0.000977",
    ]
    # No shadow at step 3: its columns say so.
    assert table_row(first.stdout, "3")[2:] == [
        "0.781%",
        "2^-5",
        "2^-30",
        "20.8 doublings",
        "12.5%",
        "-",
        "-",
        "-",
    ]
    assert f"More: halfway gradients {sampled} --after-step 3" in first.stdout
    assert find_row(first.stdout, "6") is None

    rest = cli(live, "gradients", str(sampled), "--after-step", "3")
    assert [table_row(rest.stdout, s)[0] for s in ("6", "9")] == ["6", "9"]
    assert find_row(rest.stdout, "3") is None and "More:" not in rest.stdout


def test_gradients_variables_adds_each_variable_at_the_latest_sample(
    live: Live, sampled: int
) -> None:
    result = halfway(live, "gradients", str(sampled), "--variables")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"Job {sampled} gradients by variable at step 9" in out
    assert "(loss scale 1024; no shadow at this step)" in out
    assert table_row(out, "(model)") == [
        "(model)",
        "0.781%",
        "2^-6",
        "2^-30",
        "21.8 doublings",
        "12.5%",
        "yes",
    ]
    assert table_row(out, "dense/kernel")[1:3] == ["0%", "2^-6"]
    assert table_row(out, "dense/bias") == [
        "dense/bias",
        "25%",
        "2^-7",
        "2^-31",
        "22.8 doublings",
        "12.5%",
        "yes",
    ]


def test_gradients_step_shows_that_sample_with_the_shadows_figures_per_variable(
    live: Live, sampled: int
) -> None:
    result = cli(live, "gradients", str(sampled), "--step", "6")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "gradients by variable at step 6 (loss scale 1024; with the float32 shadow)" in out
    assert table_row(out, "6")[:2] == ["6", "1024"]
    assert find_row(out, "9") is None
    assert table_row(out, "dense/bias") == [
        "dense/bias",
        "25%",
        "2^-4",
        "2^-31",
        "19.8 doublings",
        "12.5%",
        "3.13%",
        "1.56%",
        "0.000977",
        "yes",
    ]

    between = cli(live, "gradients", str(sampled), "--step", "5")
    assert between.exit_code == ExitCode.NOT_FOUND, between.output
    assert f"job {sampled} has no gradient sample at step 5" in between.stderr
    both = cli(live, "gradients", str(sampled), "--step", "6", "--limit", "3")
    assert both.exit_code == ExitCode.USAGE, both.output
    unknown = cli(live, "gradients", "999")
    assert unknown.exit_code == ExitCode.NOT_FOUND, unknown.output


def test_gradients_of_a_job_without_samples_says_so_and_how_often_it_samples(
    live: Live,
) -> None:
    queued = live.submit(TINY)
    result = cli(live, "gradients", str(queued), "--variables")
    assert result.exit_code == 0, result.output
    assert f"Job {queued} has no gradient samples after step -1 (queued)." in result.stdout
    assert f"It samples every {GradientsSpec().every} steps" in result.stdout
    shadows_only = live.submit({**TINY, "gradients": {"every": 0, "shadow_every": 40}})
    said = cli(live, "gradients", str(shadows_only)).stdout
    assert "It samples only at its float32-shadow steps, every 40 steps" in said
    off = live.submit({**TINY, "gradients": {"every": 0, "shadow_every": 0}})
    said = cli(live, "gradients", str(off)).stdout
    assert "turns the meter off (gradients.every and shadow_every are 0)" in said


def test_gradients_after_a_resume_says_the_samples_from_the_cut_were_replaced(
    live: Live,
) -> None:
    """Attempt 1 samples steps 0..19 every 5, checkpoints at 10 and is killed; attempt 2
    resumes at 10: the samples from 10 on are attempt 2's (the fake's zero share doubles)."""
    plan = [
        {"until": 20, "total": 30, "checkpoint_at": 10, "then": "crash", "gradients_every": 5},
        {"until": 30, "total": 30, "gradients_every": 5},
    ]
    job_id = run_fake(live, {"mode": "plan", "plan": plan}, max_attempts=2)
    result = cli(live, "gradients", str(job_id))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "History version 1: a resume trained the steps from 10 on again" in out
    zero = {step: table_row(out, str(step))[2] for step in (0, 5, 10, 15, 20, 25)}
    assert zero == {0: "0.781%", 5: "0.781%", 10: "1.56%", 15: "1.56%", 20: "1.56%", 25: "1.56%"}
