"""``halfway code push DIR``: pack a directory into a bundle and upload it (the digest is
what a spec's ``code.bundle`` names). ``halfway submit --code DIR`` does the same first."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from service.client.api import Client
from service.client.options import TokenOption, UrlOption, handles_errors
from service.client.render import Ui

code_app = typer.Typer(help="Code bundles: your own training code.", no_args_is_help=True)


def push(client: Client, directory: str | Path, ui: Ui) -> str:
    """Pack and upload ``directory``; print and return its digest."""
    bundle: dict[str, Any] = client.push_code(directory)
    state = "uploaded" if bundle["created"] else "already on the server"
    ui.out.print(
        f"code bundle {bundle['digest']} ({bundle['files']} files, {bundle['bytes']} bytes, "
        f"{state}) from {escape(str(directory))}"
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
    with Client(url, token) as client:
        push(client, directory, ui)
