"""`boxwarden artifacts NAME [--json]`: the sidecar's claims and their durable state."""

from __future__ import annotations

import asyncio

import click
from google.protobuf import json_format

from controller import boxes, render
from controller.cli.options import json_flag, open_state


@click.command("artifacts")
@click.argument("name")
@json_flag
def command(name: str, as_json: bool) -> None:
    """List box NAME's claims: path, size, blake3, durable."""
    listing = asyncio.run(boxes.artifacts(open_state().get(name)))
    if as_json:
        render.json_out(
            json_format.MessageToDict(
                listing, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
        )
    else:
        render.artifacts(name, listing)
