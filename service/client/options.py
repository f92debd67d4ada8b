"""What every ``halfway`` client command shares: the connection options, the job id argument,
and turning a ``HalfwayError`` into its message and exit code."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from functools import wraps
from typing import Annotated, ParamSpec

import typer
from rich.markup import escape

from service.client.config import DEFAULT_URL
from service.client.errors import ExitCode, HalfwayError
from service.client.render import err_console

P = ParamSpec("P")


def report(error: HalfwayError) -> None:
    err = err_console()
    err.print(f"[bold red]error:[/] {escape(error.message)}")
    for line in error.details:
        err.print(f"  {escape(line)}")


def handles_errors(command: Callable[P, None]) -> Callable[P, None]:
    """Turn a ``HalfwayError`` into its message and exit code, and Ctrl-C into 130."""

    @wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            command(*args, **kwargs)
        except HalfwayError as exc:
            report(exc)
            raise typer.Exit(exc.code) from None
        except KeyboardInterrupt:
            err_console().print("\ninterrupted (the job itself keeps running)")
            raise typer.Exit(ExitCode.INTERRUPTED) from None
        except BrokenPipeError:
            # The reader (head, less) has gone: stop quietly, and keep Python's final flush of
            # stdout from failing too.
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(ExitCode.OK) from None

    return run


UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help=f"Server URL. Else HALFWAY_URL, the config file, {DEFAULT_URL}.",
        show_default=False,
        rich_help_panel="Connection",
    ),
]

TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="API token. Else HALFWAY_TOKEN, the config file. (A flag shows in `ps`; "
        "prefer the environment or the config file.)",
        show_default=False,
        rich_help_panel="Connection",
    ),
]

JobId = Annotated[
    int, typer.Argument(metavar="ID", help="The job's id.", min=1, show_default=False)
]
