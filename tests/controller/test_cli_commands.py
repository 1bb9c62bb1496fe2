"""The CLI loads each command's module only when it runs: every listed name must load, under its
own name, and `artifacts --json` must not pay for the modules of the gate and the teardown."""

from __future__ import annotations

import subprocess
import sys

import click

from controller.cli import COMMANDS, cli
from tests.conftest import REPO


def test_every_listed_command_loads_under_its_name() -> None:
    ctx = click.Context(cli)
    assert cli.list_commands(ctx) == sorted(COMMANDS)
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        assert command is not None and command.name == name
    assert cli.get_command(ctx, "nope") is None


def test_the_artifacts_command_does_not_import_the_gate_or_the_teardown() -> None:
    code = (
        "import sys; from controller.cli import cli; import click; "
        "cli.get_command(click.Context(cli), 'artifacts'); "
        "print(sorted(m for m in ('controller.gate', 'controller.teardown', 'controller.verify') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
