"""The code in README.md and docs/ says what the code does.

What is checked, and how:

- every ``python`` block compiles, every name it imports from ``service`` exists, and every
  ``hw.<method>`` it calls is a method of ``service.client.Client``;
- every ``json`` block parses;
- every ``halfway`` command in a ``sh`` block names real (sub)commands and options of the real
  CLI, and every repository path in a ``sh`` block (``examples/...``, ``.ci/run``) exists;
- README's Python tour runs as written against a live server with a real worker
  (``test_the_readme_python_tour_runs_as_written``);
- every other shell block runs as written in bash against a fresh live server with a real
  worker (``test_shell_blocks_run_as_written``), from a folder laid out as the repository
  (``.venv``, ``examples``, and ``.halfway`` as the server's home), with two placeholders filled
  in: the token (``hw_...``: the admin's, which ``halfway serve`` prints on first start) and
  the server's address (``localhost:8000``). Job ids in the
  blocks (``history 1``) hold because each block gets a server of its own;
- a block that cannot run here (it installs, starts a server that runs until stopped, needs
  Docker, GPUs or other hosts, or is CI itself) carries ``<!-- not run by the tests: why -->``
  on the line before it, and its page says so in words too
  (``test_every_block_runs_or_says_why_not``).

Blocks that appear on two pages with the same text run once. ``text`` blocks show output and
are not run.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main

from service.cli import app
from service.client import Client
from service.client import commands as client_commands
from tests.live import CLIENT_ENV, Live

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = {"sh", "bash", "shell"}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


NOT_RUN = re.compile(r"<!-- not run by the tests: (.+?) -->\n$")


def blocks(language: set[str], *, runnable: bool = False) -> Iterator[tuple[str, str]]:
    """``(page:line, code)`` of each block in ``language``; with ``runnable``, only those not
    marked as not run, and each text once."""
    seen: set[str] = set()
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) not in language:
                continue
            code = match.group(2)
            if runnable and (NOT_RUN.search(text[: match.start()]) or code in seen):
                continue
            seen.add(code)
            line = text[: match.start()].count("\n") + 1
            yield f"{page.relative_to(ROOT)}:{line}", code


def ids(cases: list[tuple[str, str]]) -> list[str]:
    return [where for where, _ in cases]


PYTHON = list(blocks({"python"}))
JSON = list(blocks({"json"}))
SHELL = list(blocks(SHELLS))


def test_the_docs_have_snippets_of_each_kind() -> None:
    assert PYTHON and JSON and SHELL


@pytest.mark.parametrize(("where", "code"), PYTHON, ids=ids(PYTHON))
def test_python_blocks_compile_and_use_what_exists(where: str, code: str) -> None:
    tree = ast.parse(code, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("service"):
            module = __import__(node.module or "", fromlist=["_"])
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module}.{alias.name}"
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "hw"
        ):
            assert hasattr(Client, node.attr), f"{where}: Client has no {node.attr}"


@pytest.mark.parametrize(("where", "code"), JSON, ids=ids(JSON))
def test_json_blocks_parse(where: str, code: str) -> None:
    json.loads(code)


def shell_commands(code: str) -> Iterator[list[str]]:
    """Each simple command of a block, as words, comments and continuations removed."""
    for line in code.replace("\\\n", " ").splitlines():
        words = [w.strip("[]") for w in shlex.split(line, comments=True)]
        command: list[str] = []
        for word in words:
            if word in {"&&", "||", ";", "|"}:
                yield command
                command = []
            elif word:
                command.append(word)
        yield command


def cli() -> Any:
    """The CLI as the ``halfway`` executable builds it (typer's command tree)."""
    client_commands.register(app)
    return typer.main.get_command(app)


def check_halfway(words: list[str], where: str) -> None:
    command = cli()
    rest = list(words)
    while hasattr(command, "commands"):
        assert rest, f"{where}: `halfway {' '.join(words)}` names no command"
        name = rest.pop(0)
        sub = command.commands.get(name)
        assert sub is not None, f"{where}: no command {name!r} in `halfway {' '.join(words)}`"
        command = sub
    options = {"--help"}
    for param in command.params:
        options.update(param.opts, param.secondary_opts)
    for word in rest:
        if word.startswith("--"):
            option = word.split("=", 1)[0]
            assert option in options, f"{where}: {command.name} has no {option}"


@pytest.mark.parametrize(("where", "code"), SHELL, ids=ids(SHELL))
def test_shell_blocks_name_real_commands_options_and_files(where: str, code: str) -> None:
    for words in shell_commands(code):
        at = next((i for i, w in enumerate(words) if re.fullmatch(r"(\S*/bin/)?halfway", w)), None)
        if at is not None:
            check_halfway(words[at + 1 :], where)
        for word in words:
            if re.match(r"^(examples|\.ci|benchmarks)/", word):
                assert (ROOT / word).exists(), f"{where}: {word} does not exist"


def readme_python() -> str:
    found = [code for where, code in PYTHON if where.startswith("README.md")]
    assert len(found) == 1, "README.md has one Python block: the tour"
    return found[0]


@pytest.mark.keras
def test_the_readme_python_tour_runs_as_written(
    live: Live, worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display
    for name in ("HALFWAY_CONFIG", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(live.home))
    monkeypatch.setenv("HALFWAY_URL", live.url)
    monkeypatch.setenv("HALFWAY_TOKEN", live.team.alice)
    names: dict[str, Any] = {}
    exec(compile(readme_python(), "README.md", "exec"), names)
    assert names["final"]["status"] == "succeeded"
    df = names["df"]
    assert len(df) == names["final"]["progress"]["total_steps"]
    assert len(names["table"]) == 2  # a row per policy


def test_every_block_runs_or_says_why_not() -> None:
    """A block not run below carries its reason; the runnable Python is the tour alone (the
    one Python runner here); and most shell blocks run."""
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            reason = NOT_RUN.search(text[: match.start()])
            if reason:
                assert match.group(1) in SHELLS | {"python"}, f"{page}: a marked {match.group(1)}"
                assert len(reason.group(1).split()) >= 3, f"{page}: say why: {reason.group(0)}"
    assert [code for _, code in blocks({"python"}, runnable=True)] == [readme_python()]
    runnable = {code for _, code in SHELL_RUN}
    marked = {code for _, code in SHELL} - runnable
    assert len(runnable) >= len(marked), (sorted(runnable), sorted(marked))


SHELL_RUN = list(blocks(SHELLS, runnable=True))


@pytest.mark.keras
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the README's default
@pytest.mark.parametrize(("where", "code"), SHELL_RUN, ids=ids(SHELL_RUN))
def test_shell_blocks_run_as_written(
    where: str, code: str, live: Live, worker: Any, tmp_path: Path
) -> None:
    here = tmp_path / "here"
    here.mkdir()
    for name in (".venv", "examples"):
        (here / name).symlink_to(ROOT / name)
    (here / ".halfway").symlink_to(live.settings.home)
    address = live.url.removeprefix("http://")
    token = live.team.admin  # the one ``halfway serve`` prints on first start
    script = code.replace("hw_...", token).replace("localhost:8000", address)
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    env |= {
        "HOME": str(live.home),
        "HALFWAY_URL": live.url,
        "HALFWAY_TOKEN": token,
        "HALFWAY_HOME": str(live.settings.home),
        "HALFWAY_DATABASE_URL": live.settings.resolved_database_url(),
        "PATH": f"{ROOT / '.venv' / 'bin'}:{env['PATH']}",
    }
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"{where}:\n{script}\n{out[-4000:]}"
    assert "Traceback" not in out, f"{where}:\n{out[-4000:]}"
    # What a block waited for succeeded; a job it only submitted may still be training.
    for job in live.api("GET", "/v1/jobs?limit=100")["items"]:
        assert job["status"] in ("succeeded", "queued", "running"), (where, job["error"])
