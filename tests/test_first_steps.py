"""What a newcomer meets first, as the README walks them through it: the recovery command for a
lost token is named wherever a token is printed; the ``client`` extra brings what the Python
snippets use (pandas, and matplotlib for ``df.plot``); the own-code example's data script runs
as the README says, and its comments point where the worker reads (``.halfway/data`` when
HALFWAY_HOME is unset)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from service.client import Client
from service.settings import Settings
from tests.live import Live
from tests.test_client_cli import TINY, finish_directly, records_with_overflows
from tests.test_server_process import HALFWAY, start_server, stop_server
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
OWN_CODE = ROOT / "examples" / "own-code"


# --------------------------------------------------------------------------------------------
# Tokens: where one is printed, so is the way to get a new one


def test_first_start_names_the_command_that_replaces_a_lost_admin_token(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--no-worker")
    try:
        assert server.token.startswith("hw_"), "".join(server.output)
        text = eventually(lambda: "".join(server.output), lambda t: "users token" in t)
    finally:
        stop_server(server)
    assert "halfway users token admin" in text, text


def users(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HALFWAY_")}
    env["HALFWAY_HOME"] = str(home)
    return subprocess.run(
        [HALFWAY, "users", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_users_add_and_token_print_the_token_alone_and_name_the_recovery_command(
    tmp_path: Path,
) -> None:
    added = users(tmp_path / "home", "add", "bob")
    assert added.returncode == 0, added.stderr
    # stdout is the token alone (scripts capture it); the advice goes to stderr.
    assert re.fullmatch(r"hw_[A-Za-z0-9_-]{43}\n", added.stdout), added.stdout
    assert "halfway users token bob" in added.stderr, added.stderr

    replaced = users(tmp_path / "home", "token", "bob")
    assert replaced.returncode == 0, replaced.stderr
    assert re.fullmatch(r"hw_[A-Za-z0-9_-]{43}\n", replaced.stdout), replaced.stdout
    assert "halfway users token bob" in replaced.stderr, replaced.stderr


# --------------------------------------------------------------------------------------------
# The client extra


def test_the_client_extra_brings_pandas_and_matplotlib() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {
        re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0]
        for r in project["optional-dependencies"]["client"]
    }
    assert {"pandas", "matplotlib"} <= names, names


def test_the_readme_plot_of_a_history_frame_draws(live: Live) -> None:
    import matplotlib  # the client extra; .ci/run installs it

    matplotlib.use("Agg")  # no display
    job_id = live.submit(TINY)
    finish_directly(live, job_id, records_with_overflows(12))
    with Client(live.url, live.team.alice, env={}) as hw:
        df = hw.history(job_id)
    # As the README has it.
    axes = df.plot(x="step", y="loss_scale", logy=True)
    assert axes.get_yscale() == "log"
    steps: Any = axes.get_lines()[0].get_xdata()
    assert list(steps) == list(range(12))


def readme_line(needle: str) -> str:
    lines = [line for line in README.read_text().splitlines() if needle in line]
    assert lines, f"README has no line with {needle!r}"
    return lines[0]


def test_the_readme_says_where_pandas_comes_from_for_a_parquet_file() -> None:
    line = readme_line("--parquet run.parquet")
    if "pandas" in line:
        assert "[client]" in line, line


# --------------------------------------------------------------------------------------------
# The own-code example's data


@pytest.mark.keras
def test_the_readme_make_records_command_runs_as_written(tmp_path: Path) -> None:
    """The command the README gives, run from the repository in a shell whose ``python`` is
    not Halfway's environment (nothing activated): its interpreter must be the
    environment's. ``.venv/bin/`` is this test run's environment."""
    line = readme_line("make_records.py")
    words = shlex.split(line.split("#")[0])
    script = words.index("examples/own-code/make_records.py")
    assert words[script + 1] == ".halfway/data/own-code", line
    venv_bin = str(Path(sys.executable).parent) + "/"
    command = [w.replace(".venv/bin/", venv_bin, 1) for w in words[:script]]
    target = tmp_path / ".halfway" / "data" / "own-code"
    done = subprocess.run(
        [*command, str(ROOT / words[script]), str(target)],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in target.iterdir()) == ["train-00.tfrecord", "train-01.tfrecord"]


def test_make_records_without_tensorflow_says_which_python_to_use(tmp_path: Path) -> None:
    blocker = tmp_path / "tensorflow.py"
    blocker.write_text("raise ImportError('no tensorflow here')\n")
    done = subprocess.run(
        [sys.executable, str(OWN_CODE / "make_records.py"), str(tmp_path / "out")],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert ".venv/bin/python" in done.stderr and "[train]" in done.stderr, done.stderr


def test_the_job_comment_points_where_the_worker_reads_with_halfway_home_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    comment = next(
        line for line in (OWN_CODE / "job.yaml").read_text().splitlines() if "make_records" in line
    )
    assert "$HALFWAY_HOME" not in comment.split("(")[0], comment
    assert "make_records.py .halfway/data/own-code" in comment, comment
    # The default home is .halfway in the folder `halfway serve` runs in: its data is there.
    for name in ("HALFWAY_HOME", "HALFWAY_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    assert Settings().resolved_data_dir() == (tmp_path / ".halfway" / "data").resolve()
    # The README gives the same command.
    assert ".halfway/data/own-code" in readme_line("make_records.py")
