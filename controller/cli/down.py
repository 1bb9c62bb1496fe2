"""`boxwarden down NAME [--dry-run] [--json] [--confirm NAME]`: the gate, then the teardown and the
meter stop."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from controller import boxes, render
from controller.cli.options import json_flag, open_state
from controller.errors import GateRefused
from controller.state import Box, State, exclusive


@click.command("down")
@click.argument("name")
@click.option("--dry-run", is_flag=True, help="Show the evidence and the verdict; change nothing.")
@click.option("--confirm", metavar="NAME", help="Confirm by naming the box (otherwise you are asked).")
@click.option(
    "--pulled",
    type=click.Path(file_okay=False, path_type=Path),
    help="The pulled tree to judge (default: where `pull` put it).",
)
@click.option(
    "--meter-stopped",
    is_flag=True,
    help="For a platform whose meter is stopped by hand: you did the console steps `down` printed.",
)
@json_flag
def command(
    name: str, dry_run: bool, confirm: str | None, pulled: Path | None, meter_stopped: bool, as_json: bool
) -> None:
    """Tear box NAME down, only if every artifact is durable, pulled and verified, and you named the box."""
    if pulled is not None:
        boxes.check_path_text(pulled, "--pulled")
    state = open_state()
    box = state.get(name)
    if dry_run:
        _down(state, box, dry_run, confirm, pulled, meter_stopped, as_json)
        return
    # One `down` per box at a time: a second one would judge a box the first is tearing down.
    busy = f"another `down {name}` is running (pid {{pid}}); wait for it"
    with exclusive(Path(box.box_dir) / "down.lock", busy):
        _down(state, state.get(name), dry_run, confirm, pulled, meter_stopped, as_json)


def _down(
    state: State,
    box: Box,
    dry_run: bool,
    confirm: str | None,
    pulled: Path | None,
    meter_stopped: bool,
    as_json: bool,
) -> None:
    name = box.name
    interactive = sys.stdin.isatty() and not as_json

    async def manual_done(steps: str) -> bool:
        render.manual_steps(name, steps)
        # --meter-stopped vouches for steps already shown by an earlier `down`, never for unseen ones.
        if meter_stopped and box.status == "meter-unproven":
            return True
        return interactive and render.ask_done()

    if box.status == "meter-unproven" and not dry_run:
        # The data side is done (audited); only the meter stop is left to prove.
        if confirm != name:
            raise click.UsageError(f"name the box to retry its meter stop: --confirm {name}")
        result = asyncio.run(boxes.retry_meter(state, box, manual_done))
        if as_json:
            render.json_out({"teardown": result.to_json()})
        else:
            render.teardown(result)
        return
    pulled_dir = boxes.pulled_dir(box, pulled)
    if not dry_run and confirm is None and interactive:
        # Interactive: show the evidence first, ask for the name only if there is something to confirm.
        preview = asyncio.run(boxes.judge(box, pulled_dir, confirm=None, dry_run=True))
        render.verdict(preview, dry_run=True)
        if not preview.allowed:
            raise click.exceptions.Exit(GateRefused.exit_code)
        confirm = render.confirm_prompt(name)
    # Judged at the moment of acting (after any prompt): the box may have moved on meanwhile.
    verdict = asyncio.run(boxes.judge(box, pulled_dir, confirm=confirm, dry_run=dry_run))
    doc: dict[str, object] = {"dry_run": dry_run, **verdict.to_json()}
    if not verdict.allowed or dry_run:
        if as_json:
            render.json_out(doc)
        else:
            render.verdict(verdict, dry_run=dry_run)
        if not verdict.allowed:
            raise click.exceptions.Exit(GateRefused.exit_code)
        return
    if not as_json:
        render.verdict(verdict, dry_run=False)
    result = asyncio.run(boxes.down(state, box, verdict, manual_done))
    if as_json:
        render.json_out({**doc, "teardown": result.to_json()})
    else:
        render.teardown(result)
