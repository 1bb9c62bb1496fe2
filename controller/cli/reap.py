"""`boxwarden reap NAME --pid PID [--grace SECONDS]`: end a process a VRAM_ZOMBIE alert names."""

from __future__ import annotations

import asyncio

import click

from controller import reap, render
from controller.cli.options import grace_option, json_flag, open_state
from controller.errors import ControllerError


@click.command("reap")
@click.argument("name")
@click.option(
    "--pid",
    type=click.IntRange(1, 2**31 - 1),
    required=True,
    help="The process to end: a pid a VRAM_ZOMBIE alert names (`boxwarden status NAME`).",
)
@grace_option
@json_flag
def command(name: str, pid: int, grace: int, as_json: bool) -> None:
    """End process PID on box NAME: one that holds GPU memory outside every job (a VRAM_ZOMBIE).

    The sidecar refuses unless a GPU reading it takes now shows PID holding GPU memory outside every
    job; a job's processes are ended with `boxwarden stop`. SIGTERM, then SIGKILL after the grace.
    """
    box = open_state().get(name)
    res = asyncio.run(reap.reap_process(box, pid, grace))
    if not res.gone:
        raise ControllerError(f"pid {pid} on {name} is not gone: {res.detail}")
    if as_json:
        render.json_out(res.to_json())
    else:
        render.info(f"pid [bold]{pid}[/] on {render.esc(name)} is gone: {render.esc(res.detail)}")
