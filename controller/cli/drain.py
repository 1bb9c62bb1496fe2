"""`boxwarden drain NAME [--wait] [--timeout SECONDS] [--json]`: push everything not durable now,
newest first, and say what is still at risk.

Exit codes: 0 the sidecar answered (with --wait: and nothing is at risk at the end) · 1 error (the
sidecar unreachable, or too old for drain) · 2 usage · 3 with --wait: still at risk at the end.
"""

from __future__ import annotations

import asyncio
from contextlib import nullcontext

import click

from controller import drain, render
from controller.cli.options import json_flag, open_state, stand_aside
from controller.errors import EXIT_REFUSED, UsageError

DEFAULT_TIMEOUT_S = 3600


@click.command("drain")
@click.argument("name")
@click.option("--wait", is_flag=True, help="Show the progress until nothing is at risk or the timeout.")
@click.option(
    "--timeout",
    "timeout_s",
    type=click.IntRange(1, 86400),
    help="With --wait: the most seconds to wait (default 3600).",
)
@json_flag
def command(name: str, wait: bool, timeout_s: int | None, as_json: bool) -> None:
    """Push every claim of box NAME that is not durable yet, newest first, and show what is at risk:
    files and bytes not durable, the time they need at the measured push bandwidth, the entries not
    sealed yet. With --wait, exit 3 if anything is still at risk at the end."""
    if timeout_s is not None and not wait:
        raise UsageError("--timeout goes with --wait")
    box = open_state().get(name)
    if wait:
        stand_aside()  # it may wait an hour: never from a local box's workdir (a stray there)
    shown = render.drain_progress(name) if wait else nullcontext(None)
    with shown as on_progress:
        timeout = (timeout_s or DEFAULT_TIMEOUT_S) if wait else 0
        rep = asyncio.run(drain.drain(box, wait=wait, timeout_s=timeout, on_progress=on_progress))
    if as_json:
        render.json_out(rep.to_json())
    else:
        render.drain_report(rep)
    if wait and not rep.safe:
        raise click.exceptions.Exit(EXIT_REFUSED)
