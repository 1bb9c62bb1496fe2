"""`boxwarden status [NAME]... [--json]`: one table (or JSON) of every box, with the recorded steps
of any teardown that did not finish (e.g. `tearing-down (... meter stop sent ..., not proven)`)."""

from __future__ import annotations

import asyncio

import click

from controller import boxes, render, teardown
from controller.cli.options import json_flag, open_state, stand_aside


@click.command("status")
@click.argument("names", nargs=-1)
@json_flag
def command(names: tuple[str, ...], as_json: bool) -> None:
    """Show every box (or the named ones): sidecar, jobs, claims, durable state, disk."""
    state = open_state()
    stand_aside()
    rows = []
    for s in asyncio.run(boxes.status(state, names)):
        row = s.row()
        earlier = teardown.unfinished(state, s.box)
        if earlier is not None:
            row["teardown"] = earlier.to_json()
        rows.append(row)
    if as_json:
        render.json_out({"schema": boxes.STATUS_SCHEMA, "boxes": rows})
    else:
        render.status(rows)
