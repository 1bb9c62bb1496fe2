"""`boxwarden down NAME [--dry-run] [--json] [--confirm NAME] [--resend-stop]`: the gate, then the
teardown and the meter stop; or the continuation of a teardown that did not finish
(`teardown.unfinished` decides which)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from controller import boxes, pathtext, render, teardown
from controller.cli.options import json_flag, open_state
from controller.errors import GateRefused, UsageError
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
@click.option(
    "--resend-stop",
    is_flag=True,
    help="For a teardown whose meter stop was never proven and whose sidecar is stopped: send the stop "
    "again WITHOUT a gate (only if you know the box is being destroyed anyway; audited).",
)
@json_flag
def command(
    name: str,
    dry_run: bool,
    confirm: str | None,
    pulled: Path | None,
    meter_stopped: bool,
    resend_stop: bool,
    as_json: bool,
) -> None:
    """Tear box NAME down, only if every artifact is durable, pulled and verified, and you named the box."""
    if pulled is not None:
        pathtext.check_path_text(pulled, "--pulled")
    state = open_state()
    box = state.get(name)
    if dry_run:
        if resend_stop:
            raise UsageError("--resend-stop sends a stop: it cannot go with --dry-run")
        _down(state, box, dry_run, confirm, pulled, meter_stopped, False, as_json)
        return
    # One `down` per box at a time: a second one would judge a box the first is tearing down.
    busy = f"another `down {name}` or an `up {name}` is running (pid {{pid}}); wait for it"
    with exclusive(state.box_lock(name), busy):
        _down(state, state.get(name), dry_run, confirm, pulled, meter_stopped, resend_stop, as_json)


def _down(
    state: State,
    box: Box,
    dry_run: bool,
    confirm: str | None,
    pulled: Path | None,
    meter_stopped: bool,
    resend_stop: bool,
    as_json: bool,
) -> None:
    name = box.name
    interactive = sys.stdin.isatty() and not as_json
    earlier = teardown.unfinished(state, box)
    # --meter-stopped vouches for steps already shown by an earlier `down`, never for unseen ones.
    # Steps shown before an `up` again vouch for nothing now: that `up` brought the box back.
    shown_before = earlier is not None and earlier.meter_stop_sent and earlier.sidecar_seen_gone

    async def manual_done(steps: str) -> bool:
        render.manual_steps(name, steps)
        if meter_stopped and shown_before:
            return True
        return interactive and render.ask_done()

    answers = earlier is not None and asyncio.run(teardown.sidecar_answers(box))
    if resend_stop and (earlier is None or answers):
        why = (
            "its sidecar answers, so `down` goes through the gate" if earlier else "no teardown is unfinished"
        )
        raise UsageError(f"--resend-stop is not for {name}: {why}; leave the flag out")
    if earlier is not None and not answers:
        # An earlier teardown took steps and nothing watches the box now: no gate can run, only the
        # meter is left to settle (poll first, never a blind re-send).
        profile = boxes.box_profile(box)
        if dry_run:
            refusal = teardown.unfinished_refusal(box, earlier, resend=profile.meter_stop.mode == "argv")
            if as_json:
                reasons = [r.to_json() for r in refusal.reasons]
                render.json_out(
                    {"dry_run": True, "allowed": False, "reasons": reasons, "unfinished": earlier.to_json()}
                )
            raise refusal
        if confirm != name:
            raise click.UsageError(f"name the box to continue its teardown: --confirm {name}")
        if resend_stop and profile.meter_stop.mode != "argv":
            raise UsageError(
                f"--resend-stop: {profile.name} has no stop command to send ({profile.meter_stop.mode})"
            )
        result = asyncio.run(teardown.retry_meter(state, box, profile, manual_done, resend_stop=resend_stop))
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
