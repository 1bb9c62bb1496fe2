"""`boxwarden down NAME [--dry-run] [--json] [--confirm NAME]`: the gate, then the teardown."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from controller import boxes, render
from controller.cli.options import json_flag, open_state
from controller.errors import GateRefused


@click.command("down")
@click.argument("name")
@click.option("--dry-run", is_flag=True, help="Show the evidence and the verdict; change nothing.")
@click.option("--confirm", metavar="NAME", help="Confirm by naming the box (otherwise you are asked).")
@click.option(
    "--pulled",
    type=click.Path(file_okay=False, path_type=Path),
    help="The pulled tree to judge (default: where `pull` put it).",
)
@json_flag
def command(name: str, dry_run: bool, confirm: str | None, pulled: Path | None, as_json: bool) -> None:
    """Tear box NAME down, only if every artifact is durable, pulled and verified, and you named the box."""
    state = open_state()
    box = state.get(name)
    pulled_dir = boxes.pulled_dir(box, pulled)
    if not dry_run and confirm is None and sys.stdin.isatty() and not as_json:
        # Interactive: show the evidence first, ask for the name only if there is something to confirm.
        preview = asyncio.run(boxes.judge(box, pulled_dir, confirm=None, dry_run=True))
        render.verdict(preview, dry_run=True)
        if not preview.allowed:
            raise click.exceptions.Exit(GateRefused.exit_code)
        confirm = render.confirm_prompt(name)
    # Judged at the moment of acting (after any prompt): the box may have moved on meanwhile.
    verdict = asyncio.run(boxes.judge(box, pulled_dir, confirm=confirm, dry_run=dry_run))
    doc: dict[str, object] = {"dry_run": dry_run, **verdict.to_json()}
    if not verdict.allowed:
        if as_json:
            render.json_out(doc)
        else:
            render.verdict(verdict, dry_run=dry_run)
        raise click.exceptions.Exit(GateRefused.exit_code)
    if dry_run:
        if as_json:
            render.json_out(doc)
        else:
            render.verdict(verdict, dry_run=True)
        return
    if not as_json:
        render.verdict(verdict, dry_run=False)
    result = asyncio.run(boxes.down(state, box, verdict))
    if as_json:
        render.json_out({**doc, "teardown": result.to_json()})
    else:
        render.teardown(result)
