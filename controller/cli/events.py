"""`boxwarden events NAME [-f]`: the box's event journal, kept here as it arrives."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import click

from controller import events, render
from controller.cli.options import json_flag, open_state, stand_aside


def _line(rec: dict[str, Any], as_json: bool) -> str:
    # json.dumps writes every control and non-ASCII character as an escape: the text intact, as data.
    return json.dumps(rec, sort_keys=True) if as_json else render.event_line(rec)


@click.command("events")
@click.argument("name")
@click.option("-f", "--follow", is_flag=True, help="Keep following new events (reconnects by itself).")
@json_flag
def command(name: str, follow: bool, as_json: bool) -> None:
    """Print box NAME's event journal (one JSON object per line with --json)."""
    state = open_state()
    box = state.get(name)
    stand_aside()
    for rec in state.events(box.name, box.run_id):
        render.text_out(_line(rec, as_json))
    try:
        asyncio.run(
            events.fetch(state, box, follow=follow, on_event=lambda r: render.text_out(_line(r, as_json)))
        )
    except KeyboardInterrupt:
        return
