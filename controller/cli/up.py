"""`boxwarden up NAME --profile P ...`: run the profile's checks, start (or find) the box's sidecar,
wait for its Hello, and show the platform's danger clocks the first time."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import click

from controller import armed, boxes, render
from controller.cli.options import json_flag, open_state, roster_option
from controller.state import exclusive


@click.command("up")
@click.argument("name")
@click.option("--profile", help="Platform profile (`boxwarden profiles list`).")
@click.option(
    "--profile-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Your own profile file, validated like a shipped one.",
)
@click.option(
    "--host",
    metavar="DEST",
    help="The remote box's SSH destination: an alias from ~/.ssh/config, or user@host "
    "($BOXWARDEN_SSH_CONFIG names another ssh_config file). Paths are then paths on the box.",
)
@click.option(
    "--ssh-option",
    "ssh_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="An ssh -o option for this box (repeat), e.g. Port=2222.",
)
@click.option(
    "--box-index",
    metavar="URL",
    help="Let the box install the sidecar's dependencies from this package index of its own (by "
    "default it needs none: they travel from here).",
)
@click.option(
    "--state-on-durable",
    is_flag=True,
    help="Keep the sidecar's state (ledger, logs) and venv on the profile's durable tier, so they "
    "survive a stop (the socket stays on the box's own disk).",
)
@click.option(
    "--instance-id", help="The provider's id of this box (fills {instance_id} in the meter-stop command)."
)
@click.option(
    "--workdir",
    metavar="DIR",
    help="Jobs' working directory; relative --watch dirs are under it. Default: here (a remote box: its "
    "home).",
)
@click.option(
    "--watch",
    "watch",
    multiple=True,
    metavar="DIR",
    help="Checkpoint directory to watch (repeat).",
)
@click.option(
    "--durable",
    metavar="URL",
    help="Durable storage: file:///dir (on the box) or s3://BUCKET/PREFIX[?endpoint_url=URL&region=NAME"
    "&addressing_style=path]. Default: the box's own dir.",
)
@click.option(
    "--durable-credentials",
    type=click.Path(path_type=Path, dir_okay=False),
    metavar="FILE",
    help="For s3://: a credentials file ([default] aws_access_key_id, aws_secret_access_key, "
    "aws_session_token; mode 0600), kept 0600 in the sidecar's state dir on the box. Default: the "
    "box's own AWS sources.",
)
@click.option("--run-id", help="Immutable id of this run. Default: NAME-<timestamp>.")
@click.option(
    "--exclude",
    "exclude",
    multiple=True,
    metavar="PATTERN",
    help="Never claim, pull or delete files matching this glob (repeat): without '/' it matches the base "
    "name, with '/' the path under the watched dir; '*' also matches '/', so 'logs/*' leaves out "
    "everything under logs/. The gate's evidence names the files left out.",
)
@click.option(
    "--keep",
    metavar="RULES",
    help="Retention of box-side copies, e.g. last=3,best=metrics.json:loss,every=10: a checkpoint no rule "
    "keeps loses its box copy once its durable copy re-reads equal (it stays a claim, pulled from "
    "durable storage). Nothing is deleted from durable storage. Default: keep every box copy.",
)
@click.option(
    "--push-rate",
    metavar="RATE",
    help="Bytes per second the box's pushes and their re-reads keep to, e.g. 200M or 1G ('max': no "
    "limit). Every byte pushed crosses the caches and memory bus the trainer uses: at full speed a push "
    "slowed a CPU-bound trainer's steps by 10-25%, at the default 400M by ~3%. A drain (SIGTERM, "
    "`boxwarden drain --wait`) and the re-reads of `down` always go at full speed.",
)
@click.option(
    "--stall-minutes",
    type=click.FloatRange(min=1, max=7 * 24 * 60),
    help="JOB_STALLED when a running job wrote no log line and no checkpoint for this long. Default: 30.",
)
@click.option(
    "--step-regex",
    metavar="REGEX",
    help="The step in a job's log, as a Python regex with a group (?P<step>...). Default: HF Trainer, "
    "Lightning, tqdm and `step N` lines.",
)
@click.option(
    "--loss-regex",
    metavar="REGEX",
    help="The loss in a job's log, with a group (?P<loss>...). Default: `loss=X`, `loss: X`, `'loss': X`.",
)
@click.option(
    "--memory-high",
    "memory_high_percent",
    type=click.IntRange(1, 100),
    metavar="PERCENT",
    help="MEMORY_HIGH over this share of the box's memory limit (its cgroup's, else the host's). "
    "Default: 90.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    metavar="PORT",
    help="Serve Prometheus metrics on the box's 127.0.0.1:PORT (0: none, the default); `boxwarden "
    "metrics NAME` forwards it here from a remote box.",
)
@click.option(
    "--price-per-hour",
    type=click.FloatRange(min=0),
    metavar="PRICE",
    help="What the box costs an hour: `watch` shows the cost of a box left idle.",
)
@click.option(
    "--adopt",
    is_flag=True,
    help="Take over the sidecar that already runs this box (another controller started it, or this "
    "one lost its state): its run, store, watched dirs and settings are taken from it. Without it, `up` "
    "refuses a sidecar it did not start.",
)
@roster_option
@json_flag
def command(
    name: str,
    profile: str | None,
    profile_file: Path | None,
    host: str | None,
    ssh_options: tuple[str, ...],
    box_index: str | None,
    state_on_durable: bool,
    instance_id: str | None,
    workdir: str | None,
    watch: tuple[str, ...],
    durable: str | None,
    durable_credentials: Path | None,
    run_id: str | None,
    roster: tuple[str, ...],
    exclude: tuple[str, ...],
    keep: str | None,
    push_rate: str | None,
    stall_minutes: float | None,
    step_regex: str | None,
    loss_regex: str | None,
    memory_high_percent: int | None,
    metrics_port: int | None,
    price_per_hour: float | None,
    adopt: bool,
    as_json: bool,
) -> None:
    """Start the sidecar for box NAME (idempotent: a running sidecar of this version is left alone)."""
    boxes.check_name(name)  # before its lock's path is made from it
    state = open_state()
    # Never while a `down` of the box runs: a sidecar started during its meter stop would watch
    # (and run jobs on) a box that `down` then reports gone.
    busy = f"a `down {name}` is running (pid {{pid}}); wait for it to end before `up {name}`"
    with exclusive(state.box_lock(name), armed.blocking(state, name, busy)):
        out = asyncio.run(
            boxes.up(
                state,
                name,
                profile=profile,
                profile_file=profile_file,
                instance_id=instance_id,
                workdir=workdir,
                watch=watch,
                durable=durable,
                run_id=run_id,
                roster=roster,
                exclude=exclude,
                host=host,
                ssh_options=ssh_options,
                # Absolute: the ssh processes run in "/" (controller.ssh.master).
                ssh_config=os.path.abspath(c) if (c := os.environ.get("BOXWARDEN_SSH_CONFIG")) else "",
                box_index=box_index,
                state_on_durable=state_on_durable,
                durable_credentials=durable_credentials,
                keep=keep,
                push_rate=push_rate,
                health=boxes.HealthOptions(
                    stall_s=round(stall_minutes * 60) if stall_minutes is not None else None,
                    step_regex=step_regex,
                    loss_regex=loss_regex,
                    memory_high_percent=memory_high_percent,
                    metrics_port=metrics_port,
                ),
                price_per_hour=price_per_hour,
                adopt=adopt,
            )
        )
    if as_json:
        render.json_out(
            {
                "box": out.box.name,
                "profile": out.profile.name,
                "started": out.result.started,
                "adopted": adopt,
                "restarted_for": out.result.restarted_for,
                "pid": out.result.hello.pid,
                "run_id": out.box.run_id,
                "durable": out.box.durable,
                "checks": [f.to_json() for f in out.findings],
                "danger_clocks": [c.__dict__ for c in out.profile.danger_clocks] if out.first_time else [],
            }
        )
        return
    render.up_result(out.box, out.result)
    render.findings(out.findings)
    if out.first_time:
        render.platform_notices(out.profile)
