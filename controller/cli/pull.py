"""`boxwarden pull NAME [--to DIR] [--from box|durable] [--durable-credentials FILE] [--json]`: bring
every claim home, hashed on receipt: from the box, or (the box is gone) from its durable store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from controller import reach, render
from controller.cli.options import durable_credentials_option, json_flag, open_state
from controller.errors import UsageError


@click.command("pull")
@click.argument("name")
@click.option(
    "--to",
    "to",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local directory (default: the last one used, else ./pulled-NAME).",
)
@click.option(
    "--from",
    "source",
    type=click.Choice(["box", "durable"]),
    default="box",
    show_default=True,
    help="durable: the box or its sidecar is gone; read the durable copies of the claims the box last "
    "listed (kept here) from this machine.",
)
@durable_credentials_option
@json_flag
def command(name: str, to: Path | None, source: str, durable_credentials: Path | None, as_json: bool) -> None:
    """Pull box NAME's claimed artifacts and write MANIFEST.json beside them."""
    if durable_credentials is not None and source != "durable":
        raise UsageError("--durable-credentials goes with --from durable (the box reads its own store)")
    state = open_state()
    box = state.get(name)
    dest = to or (Path(box.pulled_dir) if box.pulled_dir else Path(f"pulled-{name}"))
    with render.transfer_progress() as progress:
        if source == "durable":
            from controller import fromdurable

            rep = asyncio.run(
                fromdurable.pull_durable(state, box, dest.resolve(), progress, durable_credentials)
            )
        else:
            rep = asyncio.run(reach.pull_box(state, box, dest.resolve(), progress))
    if as_json:
        render.json_out(rep.to_json())
    else:
        render.pull_report(rep)
