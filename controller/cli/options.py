"""Options shared by several commands, and the controller state every command opens."""

from __future__ import annotations

import os

import click

from controller.state import State, default_home

json_flag = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
roster_option = click.option(
    "--roster",
    "roster",
    multiple=True,
    metavar="CELL",
    help="An expected cell (repeat). The roster is explicit: never inferred from what exists.",
)


def open_state() -> State:
    """The controller state under $BOXWARDEN_HOME (default: the XDG state dir)."""
    return State(default_home(os.environ))
