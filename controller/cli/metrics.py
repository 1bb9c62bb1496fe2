"""`boxwarden metrics NAME [--port PORT]`: where to scrape the box's Prometheus metrics from here."""

from __future__ import annotations

import asyncio

import click

from controller import metrics, render
from controller.cli.options import json_flag, open_state, stand_aside


@click.command("metrics")
@click.argument("name")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=None,
    help="A remote box: the local port of the forward (default: a free one).",
)
@json_flag
def command(name: str, port: int | None, as_json: bool) -> None:
    """The URL of box NAME's Prometheus metrics on this machine (`up --metrics-port`).

    A local box's URL is printed at once. For a remote box an SSH forward brings the box's port to
    127.0.0.1:PORT here; it runs until Ctrl-C (point Prometheus at the URL meanwhile).
    """
    box = open_state().get(name)
    stand_aside()

    def ready(url: str, forwarded: bool) -> None:
        if as_json:
            render.json_out({"box": name, "url": url, "forwarded": forwarded}, compact=True)
        else:
            render.info(f"{render.esc(name)}'s metrics: {render.esc(url)}")
            if forwarded:
                render.info("forwarded over SSH until Ctrl-C")

    asyncio.run(metrics.serve(box, port or 0, ready))
