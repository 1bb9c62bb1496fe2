"""`boxwarden stop NAME JOB [--grace SECONDS]`: end a job and every process of it."""

from __future__ import annotations

import asyncio

import click
from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import reach, render
from controller.cli.options import grace_option, json_flag, open_state
from controller.errors import ControllerError


@click.command("stop")
@click.argument("name")
@click.argument("job_id", metavar="JOB")
@grace_option
@json_flag
def command(name: str, job_id: str, grace: int, as_json: bool) -> None:
    """Stop job JOB on box NAME: SIGTERM to each of its processes, SIGKILL after the grace."""
    box = open_state().get(name)
    job = asyncio.run(reach.stop_job(box, job_id, grace))
    if job.state == pb.JOB_STATE_RUNNING:
        live = " ".join(map(str, job.live_pids)) or "none seen"
        raise ControllerError(
            f"job {job_id} on {name} is still running after SIGKILL (live: {live}): a process in "
            "uninterruptible I/O ends when its I/O does; run stop again"
        )
    if as_json:
        render.json_out({"id": job.id, "state": render.job_state(job), "live_pids": list(job.live_pids)})
    else:
        render.job_stopped(job)
