"""`boxwarden run NAME [--cell CELL] -- CMD ARGS...`: start a supervised job on the box."""

from __future__ import annotations

import asyncio

import click

from controller import boxes, render
from controller.cli.options import json_flag, open_state


@click.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.option("--cell", default="", help="Roster cell this job produces (a name like a box name).")
@json_flag
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def command(name: str, cell: str, as_json: bool, argv: tuple[str, ...]) -> None:
    """Run CMD on box NAME in its own session, with its output in a log file."""
    if cell:
        boxes.check_name(cell, "cell")  # a roster cell is one path component, checked before anything
    box = open_state().get(name)
    job = asyncio.run(boxes.run_job(box, argv, cell))
    if as_json:
        render.json_out({"id": job.id, "pid": job.pid, "cell": job.cell, "log_path": job.log_path})
    else:
        render.job_started(job)
