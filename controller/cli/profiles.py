"""`boxwarden profiles list | show NAME`: what a newcomer to a platform must know before renting."""

from __future__ import annotations

from pathlib import Path

import click

from controller import profiles as profile_data
from controller import render
from controller.cli.options import json_flag, stand_aside


@click.group("profiles")
def command() -> None:
    """Platform profiles: survival matrix, meter-stop verb, spot grace, danger clocks."""


@command.command("list")
@json_flag
def list_(as_json: bool) -> None:
    """Every shipped profile, one line each."""
    stand_aside()
    loaded = [profile_data.load(n) for n in profile_data.available()]
    if as_json:
        render.json_out({"profiles": [render.profile_summary(p) for p in loaded]})
    else:
        render.profile_list(loaded)


@command.command("show")
@click.argument("name", required=False)
@click.option(
    "--profile-file", type=click.Path(dir_okay=False, path_type=Path), help="Show your own profile file."
)
@json_flag
def show(name: str | None, profile_file: Path | None, as_json: bool) -> None:
    """One profile in full: the tiers and what survives, the meter stop, spot, danger clocks."""
    p = profile_data.resolve(name, profile_file)
    stand_aside()
    if as_json:
        render.json_out(render.profile_json(p))
    else:
        render.profile_show(p)
