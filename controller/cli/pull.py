"""`boxwarden pull (NAME [--to DIR] [--from box|durable] [--durable-credentials FILE] | --all [--to-root
DIR]) [--json]`: bring every claim home, hashed on receipt: from the box, or (the box is gone) from its
durable store; or from every box that is up at once, each into its own tree (`controller.fleetops`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from controller import reach, render
from controller.cli.options import durable_credentials_option, json_flag, open_state
from controller.errors import UsageError


@click.command("pull")
@click.argument("name", required=False)
@click.option(
    "--all",
    "every",
    is_flag=True,
    help="Every box that is up, at once, each into its own tree (the one it was last pulled into, "
    "else TO_ROOT/pulled-NAME), with a bar per box and one for all.",
)
@click.option(
    "--to",
    "to",
    type=click.Path(file_okay=False, path_type=Path),
    help="Local directory (default: the last one used, else ./pulled-NAME).",
)
@click.option(
    "--to-root",
    type=click.Path(file_okay=False, path_type=Path),
    help="With --all: where the tree of a box never pulled before goes, as pulled-NAME (default: .).",
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
def command(
    name: str | None,
    every: bool,
    to: Path | None,
    to_root: Path | None,
    source: str,
    durable_credentials: Path | None,
    as_json: bool,
) -> None:
    """Pull box NAME's claimed artifacts (or every box's: --all) and write MANIFEST.json beside them."""
    if durable_credentials is not None and source != "durable":
        raise UsageError("--durable-credentials goes with --from durable (the box reads its own store)")
    if every:
        _check_all(name, to, source)
        _pull_all(to_root, as_json)
        return
    if name is None:
        raise UsageError("name the box to pull (or --all for every box that is up)")
    if to_root is not None:
        raise UsageError("--to-root goes with --all; one box's tree is --to DIR")
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


def _check_all(name: str | None, to: Path | None, source: str) -> None:
    if name is not None:
        raise UsageError(f"give a box NAME or --all, not both (`pull {name}` or `pull --all`)")
    if to is not None:
        raise UsageError(
            "--to names one box's tree; with --all each box goes into its own (the one it was last "
            "pulled into, else --to-root DIR/pulled-NAME)"
        )
    if source != "box":
        raise UsageError(
            "--all pulls from the boxes that are up; a gone box is pulled on its own: "
            "`pull NAME --from durable`"
        )


def _pull_all(to_root: Path | None, as_json: bool) -> None:
    from controller import fleetops

    state = open_state()
    fleet = fleetops.up_boxes(state)
    targets = fleetops.pull_targets(fleet, to_root)
    with render.fleet_progress([b.name for b in fleet]) as progress:
        outcomes = asyncio.run(fleetops.pull_all(state, fleet, targets, progress.box, progress.ended))
    failed = [o for o in outcomes if o.error]
    if as_json:
        render.json_out(
            {
                "boxes": [o.to_json() for o in outcomes],
                "pulled": len(outcomes) - len(failed),
                "failed": len(failed),
            }
        )
    else:
        render.fleet_pull_report(outcomes)
    if failed:
        raise click.exceptions.Exit(1)
