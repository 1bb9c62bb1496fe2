"""`boxwarden up NAME --profile P ...`: start (or find) the box's sidecar and wait for its Hello."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from controller import boxes, render
from controller.cli.options import open_state, roster_option


@click.command("up")
@click.argument("name")
@click.option("--profile", required=True, help="Platform profile (this version: local).")
@click.option("--host", help="SSH target of a remote box (not supported by this version).")
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=".",
    show_default=True,
    help="Jobs' working directory; relative --watch dirs are under it.",
)
@click.option(
    "--watch",
    "watch",
    multiple=True,
    type=click.Path(path_type=Path),
    metavar="DIR",
    help="Checkpoint directory to watch (repeat).",
)
@click.option(
    "--durable", metavar="URL", help="Durable storage URL (file:///dir). Default: the box's own dir."
)
@click.option("--run-id", help="Immutable id of this run. Default: NAME-<timestamp>.")
@roster_option
def command(
    name: str,
    profile: str,
    host: str | None,
    workdir: Path,
    watch: tuple[Path, ...],
    durable: str | None,
    run_id: str | None,
    roster: tuple[str, ...],
) -> None:
    """Start the sidecar for box NAME (idempotent: a running sidecar of this version is left alone)."""
    if host:
        raise click.UsageError(
            "--host (remote boxes over SSH) is not supported by this version; use --profile local"
        )
    state = open_state()
    box, res = asyncio.run(
        boxes.up(
            state,
            name,
            profile=profile,
            workdir=workdir,
            watch=watch,
            durable=durable,
            run_id=run_id,
            roster=roster,
        )
    )
    render.up_result(box, res)
