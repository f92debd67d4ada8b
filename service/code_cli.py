"""``halfway code push DIR``: pack a directory into a bundle and upload it (the digest is
what a spec's ``code.bundle`` names). ``halfway submit --code DIR`` does the same first."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from service import codepack
from service.client_cli import (
    CliError,
    ExitCode,
    HalfwayClient,
    TokenOption,
    Ui,
    UrlOption,
    connect,
    handles_errors,
)

code_app = typer.Typer(help="Code bundles: your own training code.", no_args_is_help=True)


def push(client: HalfwayClient, directory: str, ui: Ui) -> str:
    """Pack and upload ``directory``; print and return its digest."""
    root = Path(directory)
    if not root.is_dir():
        raise CliError(f"--code {directory}: not a directory", ExitCode.USAGE)
    files = codepack.files(root)
    if not files:
        raise CliError(f"{directory} holds no files to pack", ExitCode.USAGE)
    bundle, created = client.upload_code(codepack.pack(root))
    state = "uploaded" if created else "already on the server"
    ui.out.print(
        f"code bundle {bundle['digest']} ({bundle['files']} files, {bundle['bytes']} bytes, "
        f"{state}) from {escape(directory)}"
    )
    digest: str = bundle["digest"]
    return digest


@code_app.command("push")
@handles_errors
def push_command(
    directory: Annotated[str, typer.Argument(metavar="DIR", help="The code's folder.")],
    url: UrlOption = None,
    token: TokenOption = None,
) -> None:
    """Pack DIR (skipping .git, __pycache__, virtualenvs and what .halfwayignore names) and
    upload it; prints the digest to put in a spec's code.bundle."""
    ui = Ui.create()
    with connect(url, token) as client:
        push(client, directory, ui)
