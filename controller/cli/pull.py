"""`boxwarden pull NAME [--to DIR] [--json]`: bring every claim home, hashed on receipt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from controller import reach, render
from controller.cli.options import json_flag, open_state


@click.command("pull")
@click.argument("name")
@click.option(
    "--to",
    "to",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local directory (default: the last one used, else ./pulled-NAME).",
)
@json_flag
def command(name: str, to: Path | None, as_json: bool) -> None:
    """Pull box NAME's claimed artifacts and write MANIFEST.json beside them."""
    state = open_state()
    box = state.get(name)
    dest = to or (Path(box.pulled_dir) if box.pulled_dir else Path(f"pulled-{name}"))
    with render.transfer_progress() as progress:
        rep = asyncio.run(reach.pull_box(state, box, dest.resolve(), progress))
    if as_json:
        render.json_out(rep.to_json())
    else:
        render.pull_report(rep)
