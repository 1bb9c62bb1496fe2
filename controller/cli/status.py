"""`boxwarden status [NAME]... [--json]`: one table (or JSON) of every box."""

from __future__ import annotations

import asyncio

import click

from controller import boxes, render
from controller.cli.options import json_flag, open_state


@click.command("status")
@click.argument("names", nargs=-1)
@json_flag
def command(names: tuple[str, ...], as_json: bool) -> None:
    """Show every box (or the named ones): sidecar, jobs, claims, durable state, disk."""
    rows = [s.row() for s in asyncio.run(boxes.status(open_state(), names))]
    if as_json:
        render.json_out({"boxes": rows})
    else:
        render.status(rows)
