"""`boxwarden logs NAME [--job ID] [-f]`: a job's output."""

from __future__ import annotations

import asyncio

import click

from controller import boxes, render
from controller.cli.options import open_state, stand_aside


@click.command("logs")
@click.argument("name")
@click.option("--job", "job_id", default="", help="Job id (default: the newest job).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job exits.")
def command(name: str, job_id: str, follow: bool) -> None:
    """Print the log of a job on box NAME: its bytes into a file or a pipe, on a terminal with every
    control character shown escaped (`| cat` shows them as they are)."""
    box = open_state().get(name)
    stand_aside()

    write = render.log_writer()

    async def go() -> None:
        async for data in boxes.logs(box, job_id, follow):
            write(data)

    asyncio.run(go())
