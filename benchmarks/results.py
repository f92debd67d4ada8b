"""Each benchmark's printout on the one results page (docs/results.md).

Every script in benchmarks/ takes ``--publish`` (taken off the command line here, before
the script reads its own options): the run's printout then also goes into the
results page, in a block of its own between two markers, headed by the command, the date and
the machine it ran on (CPU model, cores, load average at the start). A later published run
of the same script replaces its block; the rest of the page, the curated tables and what
they mean, stays as written. Without ``--publish`` nothing is written.

    .venv/bin/python benchmarks/claim.py --jobs 2000 --publish

A block is keyed by the script's name, so a script run with other options replaces the one
block (the header shows which options made the figures); ``--publish=LABEL`` keeps a block
of its own beside it (``load-log-panel``), for a mode worth keeping apart.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from machine import cpu_model

# HALFWAY_RESULTS_PAGE: another page to write to (the tests publish to a copy).
PAGE = Path(
    os.environ.get(
        "HALFWAY_RESULTS_PAGE", Path(__file__).resolve().parent.parent / "docs" / "results.md"
    )
)
SECTION = "## Printouts, as each script wrote them"


def machine() -> str:
    """The machine a run is on, as a results block names it."""
    load = os.getloadavg()[0]
    return f"{cpu_model()}, {os.cpu_count()} cores, load average {load:.2f} at the start"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- printout:{name} -->", f"<!-- /printout:{name} -->"


def block(name: str, command: str, when: datetime, machine_line: str, text: str) -> str:
    """One script's block, markers included."""
    start, end = markers(name)
    fence = "```"
    while fence in text:  # a printout that holds a fence gets a longer one
        fence += "`"
    return (
        f"{start}\n### `{name}`\n\n`{command}`, {when:%Y-%m-%d %H:%M} UTC, on {machine_line}.\n\n"
        f"{fence}text\n{text.rstrip()}\n{fence}\n{end}"
    )


def write_block(page: Path, name: str, new_block: str) -> None:
    """Put ``new_block`` in place of ``name``'s block on ``page``, or after the last block
    (the printouts' section is opened at the page's end the first time). Markers out of
    order or out of pairs raise ``ValueError`` and write nothing."""
    text = page.read_text()
    start, end = markers(name)
    found = (text.count(start), text.count(end))
    if found not in ((0, 0), (1, 1)) or text.find(start) > text.find(end):
        # Hand-edited: replacing from a stray marker could take curated text with it.
        raise ValueError(f"{page}: the markers of {name}'s block are broken; mend them by hand")
    if found == (1, 1):
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        text = head + new_block + tail
    else:
        if SECTION not in text:
            text = text.rstrip("\n") + f"\n\n{SECTION}\n"
        text = text.rstrip("\n") + "\n\n" + new_block + "\n"
    page.write_text(text)


class _Tee(io.TextIOBase):
    """Writes go to the terminal and are kept."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.kept = io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


def run(main: Callable[[], None], page: Path = PAGE) -> None:
    """Run a benchmark's ``main``; with ``--publish`` on the command line, write what it
    printed to ``page``. A run that fails publishes nothing."""
    asked = [a for a in sys.argv[1:] if a == "--publish" or a.startswith("--publish=")]
    if not asked:
        main()
        return
    sys.argv = [a for a in sys.argv if a not in asked]
    label = asked[-1].partition("=")[2]
    name = Path(sys.argv[0]).stem + (f"-{label}" if label else "")
    command = shlex.join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    when, machine_line = datetime.now(UTC), machine()
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        main()
    write_block(page, name, block(name, command, when, machine_line, tee.kept.getvalue()))
    print(f"published to {page}")
