"""`boxwarden watch [PLAN|NAME...]`: a live view of boxes (see controller.watchview)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import click

from controller import fleetops, plan, render, watchview
from controller.cli.options import open_state, stand_aside
from controller.errors import UsageError

if TYPE_CHECKING:
    from rich.table import Table


@click.command("watch")
@click.argument("targets", nargs=-1, metavar="[PLAN | NAME...]")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.2, max=60),
    default=1.0,
    show_default=True,
    help="Seconds between two refreshes.",
)
@click.option("--once", is_flag=True, help="Draw the picture once and exit (for scripts and logs).")
@click.option(
    "--idle-minutes",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="BOX_IDLE for a box up this long with no job running and no cell to run (with its cost so "
    "far where `up --price-per-hour` gave its price).",
)
def command(targets: tuple[str, ...], interval: float, once: bool, idle_minutes: float) -> None:
    """Watch every box that is not down (or the boxes of PLAN, with their cells, or the named boxes)."""
    state = open_state()
    queue_name = ""
    if len(targets) == 1 and targets[0].endswith(".toml") and Path(targets[0]).is_file():
        # Only its names are read: each box is reached through its own record, as `fanout up` left it.
        p = plan.load_plan(Path(targets[0]), trusted=True)
        names = [b.name for b in p.boxes]
        queue_name = p.name
        unknown = [n for n in names if state.find(n) is None]
        if unknown:
            raise UsageError(
                f"boxes {', '.join(unknown)} of plan {p.name} are not known here: `fanout up` it first"
            )
    else:
        names = list(targets)
    # Every box not down: one whose teardown did not finish may still be metered.
    boxes = [state.get(n) for n in names] if names else fleetops.live_boxes(state)
    if not boxes:
        raise UsageError("no box is up: `boxwarden up NAME ...` or `boxwarden fanout up PLAN` first")
    stand_aside()
    from rich.console import Console
    from rich.live import Live

    console = Console(stderr=True, highlight=False)

    live = None if once else Live(console=console, refresh_per_second=4, auto_refresh=False)

    def show(t: Table, alerts: list[str]) -> None:
        out = console if live is None else live.console
        for line in alerts:
            out.print(f"[bold red]{render.esc(line)}[/]")
        if live is None:
            console.print(t)
        else:
            live.update(t, refresh=True)

    seen = [watchview.Seen(b) for b in boxes]
    with live if live is not None else contextlib.nullcontext():
        asyncio.run(
            watchview.run(
                state,
                seen,
                queue_name,
                interval_s=interval,
                once=once,
                show=show,
                idle_after_s=idle_minutes * 60,
            )
        )
