"""`boxwarden run NAME [--cell CELL] -- CMD ARGS...`: start a supervised job on the box.

`run NAME --queue cells.toml` and `run NAME --cell a --cell b ... -- CMD ARGS...` queue cells that
the sidecar runs one after another instead (see controller.queues, controller.cellsfile).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from controller import boxes, cellsfile, queues, queueview, render
from controller.cli.options import json_flag, open_state, queue_timeout_option, stand_aside
from controller.errors import UsageError


@click.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.option(
    "--cell",
    "cells",
    multiple=True,
    metavar="CELL",
    help="Roster cell this job produces (a name like a box name); {cell} in CMD is replaced by it. "
    "Repeated: a queue of these cells, each running CMD, one after another.",
)
@click.option(
    "--queue",
    "queue_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Queue the cells of this file (cells.toml; see the README) to run one after another.",
)
@click.option(
    "--queue-name",
    help="With repeated --cell: the queue's name (default: one derived from the cells and CMD, so "
    "that the same command line continues the same queue).",
)
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
@click.option(
    "--wait",
    is_flag=True,
    help="With a queue: follow it until it is over, and exit 0 only if every cell finished and its "
    "checkpoints are durable (1: a cell failed; 4: not over by --timeout).",
)
@queue_timeout_option
@json_flag
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def command(
    ctx: click.Context,
    name: str,
    cells: tuple[str, ...],
    queue_file: Path | None,
    queue_name: str | None,
    restart: str,
    max_restarts: int,
    restart_backoff: float,
    wait: bool,
    timeout: float,
    as_json: bool,
    argv: tuple[str, ...],
) -> None:
    """Run CMD on box NAME in its own session, with its output in a log file; or queue cells."""
    for cell in cells:
        boxes.check_name(cell, "cell")  # one path component, checked before anything
    if queue_file is not None or len(cells) > 1:
        plan = _queue_plan(queue_file, cells, queue_name, argv)
        explicit = {
            p: ctx.get_parameter_source(p) == click.core.ParameterSource.COMMANDLINE
            for p in ("restart", "max_restarts", "restart_backoff")
        }
        policy = boxes.RestartPolicy(
            restart if explicit["restart"] or plan.restart is None else plan.restart,
            max_restarts if explicit["max_restarts"] or plan.max_restarts is None else plan.max_restarts,
            restart_backoff
            if explicit["restart_backoff"] or plan.restart_backoff is None
            else plan.restart_backoff,
        )
        _run_queue(name, plan, policy, wait=wait, timeout=timeout, as_json=as_json)
        return
    if wait or queue_name:
        raise UsageError(
            "--wait and --queue-name go with a queue (--queue FILE, or --cell given twice or more)"
        )
    if not argv:
        raise UsageError(
            "give the command to run after the options: boxwarden run NAME [--cell CELL] -- CMD ..."
        )
    box = open_state().get(name)
    policy = boxes.RestartPolicy(restart, max_restarts, restart_backoff)
    cell = cells[0] if cells else ""
    if cell:  # as in a queue: "{cell}" in CMD is the cell
        argv = tuple(a.replace("{cell}", cell) for a in argv)
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


def _queue_plan(
    queue_file: Path | None, cells: tuple[str, ...], queue_name: str | None, argv: tuple[str, ...]
) -> cellsfile.CellsFile:
    if queue_file is not None:
        if cells or argv or queue_name:
            raise UsageError(
                "--queue FILE takes its cells, commands and name from the file: give no --cell, "
                "--queue-name or command with it"
            )
        return cellsfile.load_cells(queue_file)
    if not argv:
        raise UsageError(
            "give the command every cell runs after the options: ... --cell a --cell b -- CMD ..."
        )
    return cellsfile.cells_from_flags(cells, argv, name=queue_name)


def _run_queue(
    name: str,
    plan: cellsfile.CellsFile,
    policy: boxes.RestartPolicy,
    *,
    wait: bool,
    timeout: float,
    as_json: bool,
) -> None:
    state = open_state()
    box = state.get(name)
    resp = asyncio.run(queues.start_queue(box, plan, policy))
    q = resp.queue
    if not as_json:
        verb = "queued" if resp.started else "already running, unchanged:"
        render.info(
            f"{verb} {len(q.cells)} cells as queue [bold]{render.esc(q.name)}[/] on {render.esc(name)}"
        )
        if not wait:
            render.info(f"follow it with: boxwarden queue {name} {q.name} --wait")
    if wait:
        stand_aside()  # a follower may run for days: never from a local box's workdir (a stray there)
        q = queueview.follow(box, q.name, timeout, quiet=as_json, state=state)
    if as_json:
        render.json_out({**queues.to_json(name, q), "started": resp.started})
    elif wait:
        queueview.table(name, q)
    if wait:
        raise click.exceptions.Exit(queues.exit_code(q))
