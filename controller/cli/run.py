"""`boxwarden run NAME [--cell CELL] -- CMD ARGS...`: start a supervised job on the box."""

from __future__ import annotations

import asyncio

import click

from controller import boxes, render
from controller.cli.options import json_flag, open_state


@click.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.option("--cell", default="", help="Roster cell this job produces (a name like a box name).")
@click.option(
    "--restart",
    type=click.Choice(["never", "on-failure"]),
    default="never",
    show_default=True,
    help="on-failure: start the job again when it exits nonzero or dies of a signal, with "
    "BOXWARDEN_RESUME_FROM naming its cell's newest durable checkpoint.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="With --restart on-failure.",
)
@click.option(
    "--restart-backoff",
    type=click.FloatRange(min=0.1, max=300),
    default=10.0,
    show_default=True,
    help="Seconds before the first restart; each next one waits twice as long (at most 300 s).",
)
@json_flag
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
def command(
    name: str,
    cell: str,
    restart: str,
    max_restarts: int,
    restart_backoff: float,
    as_json: bool,
    argv: tuple[str, ...],
) -> None:
    """Run CMD on box NAME in its own session, with its output in a log file."""
    if cell:
        boxes.check_name(cell, "cell")  # a roster cell is one path component, checked before anything
    box = open_state().get(name)
    policy = boxes.RestartPolicy(restart, max_restarts, restart_backoff)
    job = asyncio.run(boxes.run_job(box, argv, cell, policy))
    if as_json:
        render.json_out(
            {
                "id": job.id,
                "pid": job.pid,
                "cell": job.cell,
                "log_path": job.log_path,
                "restart": job.restart or "never",
                "max_restarts": job.max_restarts,
            }
        )
    else:
        render.job_started(job)
