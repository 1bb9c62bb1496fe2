"""The `boxwarden` click group and its single error boundary: ControllerError → message + exit code.

Exit codes: 0 ok · 1 error · 2 usage · 3 gate refused.
"""

from __future__ import annotations

import logging
from typing import Any

import click

from controller import __version__, render
from controller.errors import ControllerError, GateRefused


class BoundaryGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except GateRefused as e:
            render.error(str(e))
            render.reasons(e.reasons)
            raise click.exceptions.Exit(e.exit_code) from e
        except ControllerError as e:
            render.error(str(e))
            raise click.exceptions.Exit(e.exit_code) from e


@click.group(cls=BoundaryGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="boxwarden")
@click.option("-v", "--verbose", count=True, help="More log output (repeat for debug).")
def cli(verbose: int) -> None:
    """boxwarden: keep a rented GPU box honest.

    The sidecar on the box seals, hashes and pushes every checkpoint and proves each copy; this CLI
    pulls the bytes home, verifies them, and lets `down` stop the meter only when nothing can be lost.
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(levelname)s %(name)s: %(message)s")


def _register() -> None:
    from controller.cli import artifacts, down, logs, profiles, pull, run, status, up, verify

    for mod in (up, run, status, artifacts, logs, pull, verify, down, profiles):
        cli.add_command(mod.command)


_register()


def main() -> None:
    cli(prog_name="boxwarden")
