"""Options shared by several commands, and the controller state every command opens."""

from __future__ import annotations

import os
from pathlib import Path

import click

from controller.durable import read_credentials
from controller.state import State, default_home

json_flag = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
grace_option = click.option(
    "--grace",
    type=click.IntRange(1, 3600),
    default=10,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL.",
)
queue_timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(min=1),
    default=7 * 24 * 3600,
    show_default="a week",
    help="With --wait: seconds to follow the queue.",
)
roster_option = click.option(
    "--roster",
    "roster",
    multiple=True,
    metavar="CELL",
    help="An expected cell (repeat). The roster is explicit: never inferred from what exists.",
)


def open_state() -> State:
    """The controller state under $BOXWARDEN_HOME (default: the XDG state dir), by its absolute
    path: a command may leave the directory it was started in (`stand_aside`)."""
    return State(default_home(os.environ).absolute())


def stand_aside() -> None:
    """Leave the user's directory for "/", once every path argument is resolved: a read-only
    command (status, watch, events -f, ...) may run on in a local box's workdir, and that box's
    sidecar counts any process standing there as a stray that holds `down`."""
    os.chdir("/")


def _checked_credentials(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    if value is not None:
        read_credentials(value)  # refused now (mode, kind, size), before anything is read or judged
    return value


durable_credentials_option = click.option(
    "--durable-credentials",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=_checked_credentials,
    help="Reading an s3:// durable store from here (pull --from durable, down --box-gone): its keys "
    "([default] aws_access_key_id, aws_secret_access_key; mode 0600). Default: boto3's own sources.",
)
