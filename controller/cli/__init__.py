"""The `boxwarden` click group and its single error boundary: ControllerError → message + exit code.

Exit codes: 0 ok · 1 error · 2 usage · 3 gate refused.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
import traceback
from typing import Any

import click

from controller import __version__, render
from controller.errors import EXIT_ERROR, ControllerError, GateRefused
from controller.state import default_home


class BoundaryGroup(click.Group):
    """The one error boundary: a ControllerError becomes its message and exit code; click's own
    exits pass through; anything else is a bug, shown as one line with its traceback in a log file."""

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
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            render.error("interrupted")
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None
        except Exception as e:
            render.error(_internal_error(e))
            raise click.exceptions.Exit(EXIT_ERROR) from e


# Each command's module, imported only when that command runs (or help lists them): a command pays
# for its own imports, not for every other command's (the whole tree costs about 0.4 s).
COMMANDS = (
    "up",
    "run",
    "stop",
    "status",
    "drain",
    "artifacts",
    "logs",
    "events",
    "pull",
    "verify",
    "down",
    "profiles",
    "reap",
    "queue",
    "metrics",
    "fanout",
    "watch",
)


class CommandsGroup(BoundaryGroup):
    """boxwarden's group: each command is loaded from `controller.cli.<name>` when it runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        command: click.Command = importlib.import_module(f"controller.cli.{cmd_name}").command
        return command


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def _internal_error(e: Exception) -> str:
    """One line for the user; the traceback goes to a log file under $BOXWARDEN_HOME/logs."""
    what = " ".join(traceback.format_exception_only(e)[-1].split())
    logs = default_home(os.environ) / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = logs / f"internal-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        # backslashreplace: an argument that is not UTF-8 (a Latin-1 file name) must not make the
        # error boundary itself fail.
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(f"boxwarden {__version__}: {' '.join(sys.argv)}\n")
            f.write("".join(traceback.format_exception(e)))
    except (OSError, ValueError):
        return f"internal error: {what}"
    return f"internal error: {what}; details in {path}"


@click.group(cls=CommandsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="boxwarden")
@click.option("-v", "--verbose", count=True, help="More log output (repeat for debug).")
def cli(verbose: int) -> None:
    """boxwarden: keep a rented GPU box honest.

    The sidecar on the box seals, hashes and pushes every checkpoint and proves each copy; this CLI
    pulls the bytes home, verifies them, and lets `down` stop the meter only when nothing can be lost.
    """
    level = logging.WARNING - 10 * verbose
    handler = logging.StreamHandler()
    handler.setFormatter(render.SafeFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=max(level, logging.DEBUG), handlers=[handler])


def main() -> None:
    cli(prog_name="boxwarden")
