"""Each benchmark writes its printout, with the machine it ran on, to the one results page
(benchmarks/results.py): a real script run with ``--publish`` against a copy of the page."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
# Helpers the benchmarks import, not benchmarks themselves.
NOT_BENCHMARKS = {"results.py", "machine.py", "listeners.py", "pollers.py"}

sys.path.insert(0, str(BENCHMARKS))
import results  # noqa: E402
from machine import cpu_model  # noqa: E402


def test_every_benchmark_can_publish() -> None:
    scripts = sorted(p for p in BENCHMARKS.glob("*.py") if p.name not in NOT_BENCHMARKS)
    assert len(scripts) >= 10
    for script in scripts:
        tree = ast.parse(script.read_text())
        last = tree.body[-1]
        assert isinstance(last, ast.If), script.name
        assert ast.unparse(last.body[0]) == "results.run(main)", script.name


def test_a_block_is_replaced_in_place_and_the_rest_of_the_page_stays(tmp_path: Path) -> None:
    page = tmp_path / "results.md"
    page.write_text("# Results\n\nCurated prose.\n")
    results.write_block(page, "claim", "<!-- printout:claim -->\nfirst\n<!-- /printout:claim -->")
    results.write_block(page, "load", "<!-- printout:load -->\nload\n<!-- /printout:load -->")
    results.write_block(page, "claim", "<!-- printout:claim -->\nsecond\n<!-- /printout:claim -->")
    text = page.read_text()
    assert text.startswith("# Results\n\nCurated prose.\n")
    assert text.count(results.SECTION) == 1
    assert text.count("<!-- printout:claim -->") == 1
    assert "first" not in text and "second" in text
    assert text.index("second") < text.index("load")  # the claim block kept its place


def test_a_printout_holding_a_fence_gets_a_longer_one() -> None:
    from datetime import UTC, datetime

    text = results.block("x", "cmd", datetime(2026, 1, 1, tzinfo=UTC), "cpu", "a\n```\nb")
    assert "````text\na\n```\nb\n````" in text


def outside(page: str, name: str) -> str:
    """The page without ``name``'s block (and the blank lines around where it was)."""
    start, end = results.markers(name)
    if start not in page:
        return page.strip()
    head, _, rest = page.partition(start)
    return (head.rstrip() + "\n" + rest.partition(end)[2].lstrip()).strip()


def test_a_published_run_writes_its_printout_and_machine_to_the_page(tmp_path: Path) -> None:
    page = tmp_path / "results.md"
    shutil.copy(ROOT / "docs" / "results.md", page)
    before = page.read_text()
    env = {**os.environ, "HALFWAY_RESULTS_PAGE": str(page)}
    command = [sys.executable, str(BENCHMARKS / "claim.py"), "--jobs", "300", "--users", "10"]
    command += ["--rounds", "1", "--per-round", "1", "--publish"]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    text = page.read_text()
    assert outside(text, "claim") == outside(before, "claim")  # the rest of the page stays
    start, end = results.markers("claim")
    written = text[text.index(start) : text.index(end)]
    assert "`benchmarks/claim.py --jobs 300 --users 10 --rounds 1 --per-round 1`" in written
    assert f"{os.cpu_count()} cores" in written and cpu_model() in written
    # The block holds what the run printed, line for line.
    printed = [line for line in out.stdout.splitlines() if not line.startswith("published to")]
    assert any("fair share / today's" in line for line in printed)
    for line in printed:
        assert line in written


def test_a_labelled_run_keeps_a_block_of_its_own(tmp_path: Path) -> None:
    page = tmp_path / "results.md"
    page.write_text("# Results\n")
    env = {**os.environ, "HALFWAY_RESULTS_PAGE": str(page)}
    base = [sys.executable, str(BENCHMARKS / "claim.py"), "--jobs", "200", "--users", "5"]
    base += ["--rounds", "1", "--per-round", "1"]
    for extra in (["--publish"], ["--publish=few-users"]):
        subprocess.run(base + extra, env=env, capture_output=True, check=True, cwd=ROOT)
    text = page.read_text()
    assert text.count("<!-- printout:claim -->") == 1
    assert text.count("<!-- printout:claim-few-users -->") == 1
    assert "--publish" not in text  # the option is taken off the command shown


@pytest.mark.parametrize(
    "broken",
    [
        "# R\n\n<!-- printout:claim -->\nold\n\nafter\n",
        "# R\n\nold\n<!-- /printout:claim -->\n\nafter\n",
        "# R\n<!-- /printout:claim -->\nold\n<!-- printout:claim -->\nafter\n",
    ],
)
def test_broken_markers_stop_the_write_and_leave_the_page_alone(
    tmp_path: Path, broken: str
) -> None:
    """A hand-edited page whose block lost a marker: replacing from a stray one could take
    curated text along, so nothing is written and the error says why."""
    page = tmp_path / "results.md"
    page.write_text(broken)
    with pytest.raises(ValueError, match="markers of claim's block are broken"):
        results.write_block(page, "claim", "<!-- printout:claim -->\nnew\n<!-- /printout:claim -->")
    assert page.read_text() == broken
