"""`boxwarden events NAME [-f]`: the box's event journal, kept here as it arrives."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import click

from controller import events
from controller.cli.options import json_flag, open_state


def _line(rec: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(rec, sort_keys=True)
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["at_unix_ns"] / 1e9))
    what = " ".join(x for x in (rec.get("path", ""), rec.get("job_id", ""), rec.get("detail", "")) if x)
    return f"{rec['seq']:>7}  {at}  {rec['kind']:<20} {what}"


@click.command("events")
@click.argument("name")
@click.option("-f", "--follow", is_flag=True, help="Keep following new events (reconnects by itself).")
@json_flag
def command(name: str, follow: bool, as_json: bool) -> None:
    """Print box NAME's event journal (one JSON object per line with --json)."""
    state = open_state()
    box = state.get(name)
    for rec in state.events(box.name, box.run_id):
        click.echo(_line(rec, as_json))
    try:
        asyncio.run(events.fetch(state, box, follow=follow, on_event=lambda r: click.echo(_line(r, as_json))))
    except KeyboardInterrupt:
        return
