"""`boxwarden down NAME [--dry-run] [--json] [--confirm NAME] [--resend-stop] [--accept-server-checksum]
[--box-gone [--durable-credentials FILE]]`: the gate, then the teardown and the meter stop; or the
continuation of a teardown that did not finish (`teardown.unfinished` decides which); or, for a box
the user says is gone, the gate on its last claims list and durable copies (`controller.gone`).

`boxwarden down --all [--dry-run] [--confirm-count N] [--accept-server-checksum] [--json]`: the gate on
every box that is not down, then, after one confirmation of how many, the teardown of those that pass, each
as `down NAME --confirm NAME` does it (`controller.fleetops`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from controller import armed, boxes, fleetops, gone, pathtext, reach, render, teardown
from controller.cli.options import durable_credentials_option, json_flag, open_state, stand_aside
from controller.errors import EXIT_ERROR, ControllerError, GateRefused, Reason, UsageError
from controller.gate import Verdict
from controller.state import Box, State, exclusive


@click.command("down")
@click.argument("name", required=False)
@click.option(
    "--all",
    "every",
    is_flag=True,
    help="Every box not down (up, or its teardown unfinished): each judged by the gate, those that "
    "pass torn down after one confirmation of how many; the others are listed with their reasons.",
)
@click.option("--dry-run", is_flag=True, help="Show the evidence and the verdict; change nothing.")
@click.option("--confirm", metavar="NAME", help="Confirm by naming the box (otherwise you are asked).")
@click.option(
    "--confirm-count",
    type=click.IntRange(min=0),
    metavar="N",
    help="With --all: confirm by the number of boxes that pass the gate (otherwise you are asked); "
    "refused, nothing torn down, if another number pass.",
)
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
@click.option(
    "--accept-server-checksum",
    is_flag=True,
    help="Take durable copies proven only by the store's checksum (S3 ?proof=server-checksum) instead of "
    "a read-back (recorded in the evidence).",
)
@click.option(
    "--box-gone",
    is_flag=True,
    help="The box is gone (preempted, destroyed) and its sidecar does not answer: judge the last claims "
    "list received from it and a `pull --from durable` of it instead of the box's live state.",
)
@click.option(
    "--accept-lost",
    is_flag=True,
    help="With --box-gone: accept that the entries the last claims list could not cover (files being "
    "written then) went with the box (recorded in the evidence).",
)
@click.option(
    "--console-shows-gone",
    is_flag=True,
    help="With --box-gone, for a profile that cannot ask its provider (no poll command): you looked in "
    "the provider's console and it shows the instance gone (destroyed, released; not stopped). No link "
    "from here may reach its host either. Recorded in the evidence.",
)
@click.option(
    "--when-safe",
    is_flag=True,
    help="With --confirm NAME: follow the box, pull and verify as its claims arrive, and tear it down "
    "through the usual gate the moment it passes (never before; Ctrl-C ends the following).",
)
@click.option(
    "--pull-to",
    type=click.Path(file_okay=False, path_type=Path),
    help="With --when-safe: where its claims are pulled (default: where `pull` put them, else "
    "./pulled-NAME).",
)
@click.option(
    "--poll",
    type=click.FloatRange(min=0.2, max=3600),
    default=5.0,
    show_default=True,
    help="With --when-safe: seconds between two looks at the box.",
)
@click.option(
    "--allow-empty",
    is_flag=True,
    help="With --when-safe: a run that left no file at all may be torn down (as `verify --allow-empty`); "
    "without it such a run is refused at once.",
)
@durable_credentials_option
@json_flag
def command(name: str | None, every: bool, **options: Any) -> None:
    """Tear box NAME down (or every box that passes the gate: --all), only if every artifact is durable,
    pulled and verified, and you named the box (or how many)."""
    # SIGTERM and SIGHUP end a `down` as Ctrl-C does: the teardown records what it did (its audit
    # record, its steps), and the links it opened are closed.
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGHUP, _terminated)  # its terminal closed
    try:
        _command(name, every, **options)
    finally:
        # Whatever the outcome (torn down, refused, a dry run, failed, interrupted): no login to a
        # box outlives the `down` that judged it.
        _end_links(name, every)


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _end_links(name: str | None, every: bool) -> None:
    with contextlib.suppress(ControllerError):
        state = open_state()
        boxes_ = [b for b in state.boxes() if b.host and (every or b.name == name)]
        if boxes_:
            asyncio.run(_end_all(boxes_))


async def _end_all(boxes_: list[Box]) -> None:
    await asyncio.gather(*(reach.end_link(b) for b in boxes_))


def _command(
    name: str | None,
    every: bool,
    dry_run: bool,
    confirm: str | None,
    confirm_count: int | None,
    pulled: Path | None,
    meter_stopped: bool,
    resend_stop: bool,
    accept_server_checksum: bool,
    box_gone: bool,
    accept_lost: bool,
    console_shows_gone: bool,
    durable_credentials: Path | None,
    when_safe: bool,
    pull_to: Path | None,
    poll: float,
    allow_empty: bool,
    as_json: bool,
) -> None:
    if when_safe:
        other = every or dry_run or resend_stop or box_gone
        _when_safe(name, confirm, pull_to, poll, allow_empty, as_json, other)
        return
    if pull_to is not None:
        raise UsageError("--pull-to goes with --when-safe (a plain `down` judges --pulled DIR)")
    if allow_empty:
        raise UsageError(
            "--allow-empty goes with --when-safe (a plain `down` judges a tree that `verify --allow-empty` "
            "verified)"
        )
    if every:
        given = {
            "NAME": name is not None,
            "--confirm": confirm is not None,
            "--pulled": pulled is not None,
            "--meter-stopped": meter_stopped,
            "--resend-stop": resend_stop,
            "--box-gone": box_gone,
            "--accept-lost": accept_lost,
            "--console-shows-gone": console_shows_gone,
            "--durable-credentials": durable_credentials is not None,
        }
        for what, present in given.items():
            if present:
                one = f"`down {name}`" if name is not None else "`down NAME`"
                raise UsageError(f"give a box NAME or --all, not both: {what} goes with one box ({one})")
        if confirm_count is not None and dry_run:
            raise UsageError("--confirm-count confirms a teardown: it cannot go with --dry-run")
        _down_all(dry_run, confirm_count, accept_server_checksum, as_json)
        return
    if name is None:
        raise UsageError("name the box to tear down (or --all for every box that is not down)")
    if confirm_count is not None:
        raise UsageError("--confirm-count goes with --all; one box is confirmed by its name: --confirm NAME")
    if pulled is not None:
        pathtext.check_path_text(pulled, "--pulled")
    if durable_credentials is not None and not box_gone:
        raise UsageError(
            "--durable-credentials goes with --box-gone (a box that answers proves its own copies)"
        )
    if accept_lost and not box_gone:
        raise UsageError("--accept-lost goes with --box-gone (a box that answers has nothing lost to accept)")
    if console_shows_gone and not box_gone:
        raise UsageError("--console-shows-gone goes with --box-gone (it is your word that the box is gone)")
    if resend_stop and box_gone:
        raise UsageError("--resend-stop continues an unfinished teardown; it does not go with --box-gone")
    opts = Opts(
        dry_run,
        confirm,
        pulled,
        meter_stopped,
        resend_stop,
        accept_server_checksum,
        box_gone,
        durable_credentials,
        accept_lost,
        console_shows_gone,
    )
    state = open_state()
    box = state.get(name)
    if dry_run:
        if resend_stop:
            raise UsageError("--resend-stop sends a stop: it cannot go with --dry-run")
        _down(state, box, opts, as_json)
        return
    # One `down` per box at a time: a second one would judge a box the first is tearing down.
    busy = f"another `down {name}` or an `up {name}` is running (pid {{pid}}); wait for it"
    with exclusive(state.box_lock(name), armed.blocking(state, name, busy)):
        _down(state, state.get(name), opts, as_json)


def _when_safe(
    name: str | None,
    confirm: str | None,
    pull_to: Path | None,
    poll: float,
    allow_empty: bool,
    as_json: bool,
    other: bool,
) -> None:
    from controller import whensafe

    if name is None or other:
        raise UsageError("--when-safe arms one box: down NAME --confirm NAME --when-safe (no --all, "
                         "--dry-run, --resend-stop or --box-gone)")  # fmt: skip
    if confirm != name:
        raise UsageError(f"name the box to arm its teardown: --confirm {name} (nothing is asked later)")
    state = open_state()
    box = state.get(name)
    dest = (pull_to or (Path(box.pulled_dir) if box.pulled_dir else Path(f"pulled-{name}"))).resolve()
    pathtext.check_path_text(dest, "--pull-to")
    stand_aside()  # it follows for hours: never from a local box's workdir (a stray there holds the gate)

    async def manual_done(steps: str) -> bool:
        render.manual_steps(name, steps)
        return False  # a manual meter stop needs a person: `down NAME --meter-stopped` then

    def report(line: str) -> None:
        render.info(f"{render.esc(name)}: {render.esc(line)}")

    async def following() -> teardown.TeardownResult:
        task = asyncio.current_task()
        assert task is not None
        # SIGTERM ends the following as Ctrl-C does: every step taken is recorded, the mark removed.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await whensafe.follow(
            state, name, dest, poll_s=poll, report=report, manual_done=manual_done, allow_empty=allow_empty
        )

    busy = f"another `down {name}` or an `up {name}` is running (pid {{pid}}); wait for it"
    with exclusive(state.box_lock(name), armed.blocking(state, name, busy)):
        render.info(f"{render.esc(name)}: armed; torn down once the gate passes (Ctrl-C to stop following)")
        try:
            result = asyncio.run(following())
        except asyncio.CancelledError:
            _left_behind(state, name)
            render.error("stopped (SIGTERM)")
            raise click.exceptions.Exit(128 + signal.SIGTERM) from None
        except GateRefused as e:
            if not any(r.code == teardown.UNFINISHED_CODE for r in e.reasons):  # that one says it
                _left_behind(state, name)
            raise
        except BaseException:
            _left_behind(state, name)
            raise
    if as_json:
        render.json_out({"teardown": result.to_json()})
    else:
        render.teardown(result)


def _left_behind(state: State, name: str) -> None:
    """Say what an interrupted or failed teardown of the box left to do, and how to finish it."""
    box = state.find(name)
    left = teardown.unfinished(state, box) if box is not None else None
    if left is not None:
        render.warn(
            f"{render.esc(name)}: its teardown did not finish: {render.esc(left.describe())}. "
            f"`boxwarden down {name} --confirm {name}` continues it (or arm it again with --when-safe)"
        )


@dataclass(frozen=True)
class Opts:
    dry_run: bool
    confirm: str | None
    pulled: Path | None
    meter_stopped: bool
    resend_stop: bool
    accept_server_checksum: bool
    box_gone: bool
    durable_credentials: Path | None
    accept_lost: bool = False
    console_shows_gone: bool = False


def _down(state: State, box: Box, o: Opts, as_json: bool) -> None:
    name = box.name
    dry_run, confirm, meter_stopped, resend_stop = o.dry_run, o.confirm, o.meter_stopped, o.resend_stop
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

    answers = earlier is not None and asyncio.run(teardown.sidecar_answers(box, own=True))
    if resend_stop and (earlier is None or answers):
        why = (
            "its sidecar answers, so `down` goes through the gate" if earlier else "no teardown is unfinished"
        )
        raise UsageError(f"--resend-stop is not for {name}: {why}; leave the flag out")
    if earlier is not None and not answers:
        if o.box_gone:
            raise UsageError(
                f"--box-gone is not for {name}: a teardown of it is unfinished and its sidecar does not "
                f"answer; `down {name} --confirm {name}` continues it (leave --box-gone out)"
            )
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
        # (the `down` that called this closes the box's link at its end, whatever the end)
        result = asyncio.run(teardown.retry_meter(state, box, profile, manual_done, resend_stop=resend_stop))
        if as_json:
            render.json_out({"teardown": result.to_json()})
        else:
            render.teardown(result)
        return
    pulled_dir = boxes.pulled_dir(box, o.pulled)

    def judge(confirm: str | None, dry_run: bool) -> Verdict:
        return asyncio.run(
            boxes.judge(
                box,
                pulled_dir,
                confirm=confirm,
                dry_run=dry_run,
                state=state,
                accept_server_checksum=o.accept_server_checksum,
                box_gone=o.box_gone,
                accept_lost=o.accept_lost,
                console_shows_gone=o.console_shows_gone,
            )
        )

    if not dry_run and confirm is None and interactive:
        # Interactive: show the evidence first, ask for the name only if there is something to confirm.
        preview = judge(None, True)
        render.verdict(preview, dry_run=True)
        if not preview.allowed:
            raise click.exceptions.Exit(GateRefused.exit_code)
        confirm = render.confirm_prompt(name)
    # Judged at the moment of acting (after any prompt): the box may have moved on meanwhile.
    verdict = judge(confirm, dry_run)
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
    if verdict.gone is not None:
        profile = boxes.box_profile(box)
        result = asyncio.run(gone.down(state, box, verdict, profile, manual_done, o.durable_credentials))
    else:
        result = asyncio.run(boxes.down(state, box, verdict, manual_done))
    if as_json:
        render.json_out({**doc, "teardown": result.to_json()})
    else:
        render.teardown(result)


def _down_all(dry_run: bool, confirm_count: int | None, accept_server_checksum: bool, as_json: bool) -> None:
    state = open_state()
    interactive = sys.stdin.isatty() and not as_json
    fleet = fleetops.live_boxes(state)
    busy: list[fleetops.DownOutcome] = []
    with contextlib.ExitStack() as stack:
        if dry_run:  # as `down NAME --dry-run`: no lock
            held = fleet
        else:  # held from the verdicts to the last teardown, the confirmation included (as `down NAME`)
            held, busy = stack.enter_context(fleetops.locked(state, fleet))
        judged = asyncio.run(fleetops.judge_all(state, held, accept_server_checksum=accept_server_checksum))
        outcomes = sorted([*judged, *busy], key=lambda o: o.box)
        passing = [o.box for o in outcomes if o.outcome == fleetops.ALLOWED]
        if not as_json and outcomes:
            render.fleet_verdicts(outcomes, dry_run=dry_run)
        problem = "" if dry_run or not passing else _confirmed(passing, confirm_count, interactive)
        if dry_run or not passing or problem:
            _done_all(outcomes, dry_run=dry_run, problem=problem, as_json=as_json)
            return
        done = asyncio.run(
            fleetops.tear_down(
                state,
                [b for b in held if b.name in passing],
                _manual_done_for(interactive),
                accept_server_checksum=accept_server_checksum,
            )
        )
    shown = {o.box for o in outcomes if o.outcome != fleetops.ALLOWED}
    outcomes = sorted([*(o for o in outcomes if o.box not in passing), *done], key=lambda o: o.box)
    outcomes = fleetops.closed_meanwhile(state, outcomes)
    if not as_json:
        render.fleet_down_report(outcomes, shown=shown)
    _done_all(outcomes, dry_run=False, problem="", as_json=as_json)


def _confirmed(passing: list[str], confirm_count: int | None, interactive: bool) -> str:
    """Empty when the user confirmed tearing down exactly the boxes that pass; else what was wrong."""
    n = len(passing)
    if confirm_count is None and interactive:
        answer = render.fleet_confirm_prompt(passing)
        return "" if answer == str(n) else f"{answer!r} is not {n}: nothing was torn down"
    if confirm_count is None:
        return (
            f"confirm by the number of boxes that pass the gate: --confirm-count {n} ({', '.join(passing)})"
        )
    if confirm_count != n:
        return (
            f"--confirm-count {confirm_count}, but {n} boxes pass the gate ({', '.join(passing)}): nothing "
            "was torn down"
        )
    return ""


def _done_all(outcomes: list[fleetops.DownOutcome], *, dry_run: bool, problem: str, as_json: bool) -> None:
    """The document (with --json), then the exit: 1 if a box failed, 3 if one was refused or the
    teardown was not confirmed, else 0."""
    reasons = [Reason("NOT_CONFIRMED", detail=problem)] if problem else []
    if as_json:
        render.json_out(
            {
                "dry_run": dry_run,
                "passing": sum(o.outcome == fleetops.ALLOWED for o in outcomes),
                "confirmed": not dry_run and not problem,
                "reasons": [r.to_json() for r in reasons],
                "boxes": [o.to_json() for o in outcomes],
            }
        )
    elif problem:
        render.error(problem)
    elif not outcomes:
        render.info("no box is up: nothing to tear down")
    if any(o.outcome == fleetops.FAILED for o in outcomes):
        raise click.exceptions.Exit(EXIT_ERROR)
    if problem or any(o.outcome == fleetops.REFUSED for o in outcomes):
        raise click.exceptions.Exit(GateRefused.exit_code)


def _manual_done_for(interactive: bool) -> Callable[[str], Callable[[str], Awaitable[bool]]]:
    """What a box's teardown asks when its meter is stopped by hand, as `down NAME` asks it: the
    steps shown and "done" asked one box at a time (the teardowns run at once), off the loop."""
    asking = asyncio.Lock()

    def for_box(name: str) -> Callable[[str], Awaitable[bool]]:
        async def manual_done(steps: str) -> bool:
            async with asking:
                render.manual_steps(name, steps)
                return interactive and await asyncio.to_thread(render.ask_done)

        return manual_done

    return for_box
