"""`boxwarden queue NAME [QUEUE] [--wait] [--stop]`: the cell queues of a box, one in detail, followed
to its end, or stopped. Exit status with QUEUE: 0 every cell finished and its checkpoints are durable;
1 a cell failed (or was cancelled, or left no checkpoint); 4 not over yet."""

from __future__ import annotations

import asyncio

import click

from controller import cellfacts, queues, queueview, render
from controller.cli.options import grace_option, json_flag, open_state, queue_timeout_option, stand_aside
from controller.errors import UsageError


@click.command("queue")
@click.argument("name")
@click.argument("queue_name", metavar="[QUEUE]", required=False)
@click.option("--wait", is_flag=True, help="Follow QUEUE until it is over (exit status as above).")
@queue_timeout_option
@click.option(
    "--stop",
    is_flag=True,
    help="Stop QUEUE: no further cell starts, and its running cell's job is stopped (as `stop`).",
)
@grace_option
@json_flag
def command(
    name: str, queue_name: str | None, wait: bool, timeout: float, stop: bool, grace: int, as_json: bool
) -> None:
    """Show the cell queues of box NAME, or QUEUE's cells; follow it (--wait) or stop it (--stop)."""
    if (wait or stop) and not queue_name:
        raise UsageError("--wait and --stop need the QUEUE's name: boxwarden queue NAME QUEUE --wait")
    if wait and stop:
        raise UsageError("give either --wait or --stop")
    state = open_state()
    box = state.get(name)
    stand_aside()
    if not queue_name:
        qs = asyncio.run(queues.list_queues(box, brief=True))
        cellfacts.learn(state, box, qs)
        if as_json:
            render.json_out({"box": name, "queues": [queues.to_json(name, q) for q in qs]})
        else:
            queueview.listing(name, qs)
        return
    if stop:
        q = asyncio.run(queues.stop_queue(box, queue_name, grace))
    elif wait:
        q = queueview.follow(box, queue_name, timeout, quiet=as_json, state=state)
    else:
        q = queues.pick(box, asyncio.run(queues.list_queues(box, queue_name)), queue_name)
    cellfacts.learn(state, box, [q])
    if as_json:
        render.json_out(queues.to_json(name, q))
    else:
        queueview.table(name, q)
    raise click.exceptions.Exit(queues.exit_code(q))
