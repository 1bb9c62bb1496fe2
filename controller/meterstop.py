"""The meter stop: run the profile's verb after the gate passed, then prove the instance is gone.

A provider's "deleted" answer is not proof (RunPod and vast.ai answer before the instance is gone),
and neither is its silence: "gone" is reported only when the poll command ran and showed it gone.
The poll runs whatever the stop command answered (an "already deleted" error is common on a retry),
and a retry polls first: gone is recorded without sending anything; a box still there gets the stop
again only when the caller says so (`send`: after a gate passed, or the user's explicit word). A
poll that could not run, or was killed, never counts. `before_send` records the step before the stop
command runs (or the manual steps are shown), so that a controller killed meanwhile leaves a trace.
A manual verb prints the exact console steps and needs the user to say they did them. Commands are
argv lists filled from validated values before anything is released; no shell ever sees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from controller.errors import ControllerError
from controller.profiles import Profile
from controller.state import Box
from controller.templates import fill

OUTPUT_TAIL = 2000
COMMAND_TIMEOUT_S = 300.0


@dataclass
class MeterResult:
    mode: str
    verb: str
    gone: bool = False
    command: list[str] = field(default_factory=list)
    exit_code: int | None = None
    output: str = ""
    polls: int = 0
    last_poll: str = ""
    waited_s: float = 0.0
    manual_confirmed: bool = False
    sent: bool = False  # this run sent the stop command (or showed the manual steps)
    shared_with: list[str] = field(default_factory=list)  # boxes still up on the instance: not sent
    detail: str = ""
    note: str = ""

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Ran:
    """What a command did. `ran` is False when it could not be started or had to be killed: then its
    code is made up and proves nothing."""

    code: int
    stdout: str
    stderr: str
    ran: bool = True


@dataclass(frozen=True)
class Plan:
    """The filled commands, built before anything on the box is released: a missing or invalid
    value fails here, while the box still holds its data."""

    stop: list[str]
    poll: list[str]


async def run_argv(argv: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> Ran:
    """Run a filled command in its own session; on a timeout (or Ctrl-C) kill its whole process
    group, so that nothing it started lives on to act on the provider after we gave up on it."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as e:
        return Ran(127, "", f"cannot run {argv[0]!r}: {e.strerror}", ran=False)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    except TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        return Ran(-9, "", f"{argv[0]} did not finish within {timeout_s:.0f}s and was killed", ran=False)
    except BaseException:
        _kill_group(proc.pid)
        raise
    assert proc.returncode is not None
    return Ran(
        proc.returncode,
        out.decode(errors="replace")[-OUTPUT_TAIL:],
        err.decode(errors="replace")[-OUTPUT_TAIL:],
    )


def _kill_group(pgid: int) -> None:
    """SIGKILL the session's process group (its leader's pid is its id; the group outlives the
    leader while any member lives)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def plan(profile: Profile, box: Box) -> Plan | None:
    """The meter-stop commands with every placeholder filled (None: no command to run)."""
    ms = profile.meter_stop
    if ms.mode != "argv":
        return None
    assert ms.poll is not None  # the loader requires a poll for mode argv
    values = {"instance_id": box.instance_id, "box": box.name}
    return Plan(stop=fill(ms.argv, values), poll=fill(ms.poll.argv, values))


def _shows_gone(profile: Profile, p: Ran) -> bool:
    poll = profile.meter_stop.poll
    assert poll is not None
    if not p.ran:
        return False
    if poll.gone_exit_code is not None:
        return p.code == poll.gone_exit_code
    return poll.gone_stdout is not None and poll.gone_stdout in p.stdout


GONE, LISTED, UNANSWERED, UNKNOWN = "gone", "listed", "unanswered", "unknown"


async def provider_says(profile: Profile, box: Box) -> tuple[str, str]:
    """One poll of the provider, sending nothing: (GONE, LISTED, UNANSWERED or UNKNOWN, what it
    said). A poll that could not run (or was killed) is UNANSWERED; a profile without a poll command
    (no meter, or a console only the user sees) can ask no provider: UNKNOWN."""
    cmds = plan(profile, box)
    if cmds is None:
        mode = profile.meter_stop.mode
        return UNKNOWN, f"the profile {profile.name} has no command that asks the provider ({mode})"
    p = await run_argv(cmds.poll, timeout_s=60.0)
    if not p.ran:
        return UNANSWERED, f"`{' '.join(cmds.poll)}` did not run: {p.stderr.strip()}"
    said = (p.stdout.strip() or p.stderr.strip())[-300:]
    return (GONE if _shows_gone(profile, p) else LISTED), f"`{' '.join(cmds.poll)}` exit {p.code}: {said}"


def unlisted(word: str, box: Box) -> str:
    """What a poll that did not say LISTED says of the box's instance, in words."""
    return "could not be asked" if word == UNANSWERED else f"does not list {box.instance_id}"


async def stop_meter(
    profile: Profile,
    box: Box,
    *,
    manual_done: Callable[[str], Awaitable[bool]],
    retry: bool = False,
    send: bool = True,
    before_send: Callable[[str], None] = lambda what: None,
    run: Callable[[list[str]], Awaitable[Ran]] = run_argv,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> MeterResult:
    ms = profile.meter_stop
    result = MeterResult(mode=ms.mode, verb=ms.verb, note=ms.note)
    if ms.mode == "none":
        result.gone = True
        result.detail = "nothing bills on this platform; the sidecar is stopped"
        return result
    if ms.mode == "manual":
        before_send("console steps shown")
        result.sent = True
        result.manual_confirmed = await manual_done(ms.manual)
        result.detail = "the user confirmed the console steps" if result.manual_confirmed else "not confirmed"
        return result
    cmds = plan(profile, box)
    assert cmds is not None and ms.poll is not None
    result.command = cmds.stop

    async def poll_once() -> bool:
        p = await run(cmds.poll)
        result.polls += 1
        said = (p.stdout.strip() or p.stderr.strip())[-300:]
        result.last_poll = f"exit {p.code}: {said}" if p.ran else f"did not run: {p.stderr.strip()}"
        return _shows_gone(profile, p)

    if retry and await poll_once():
        result.gone = True
        result.detail = f"gone: {' '.join(cmds.poll)} showed it (nothing sent again)"
        return result
    if retry and not send:
        result.detail = (
            f"still there: {' '.join(cmds.poll)} said {result.last_poll!r}; the stop was not sent again"
        )
        return result
    before_send(" ".join(cmds.stop))
    result.sent = True
    ran = await run(cmds.stop)
    result.exit_code = ran.code if ran.ran else None
    result.output = (ran.stdout + ran.stderr)[-OUTPUT_TAIL:]
    started = clock()
    while True:
        if await poll_once():
            result.gone = True
            result.waited_s = round(clock() - started, 3)
            result.detail = f"gone: {' '.join(cmds.poll)} showed it after {result.polls} poll(s)"
            return result
        result.waited_s = round(clock() - started, 3)
        left = ms.timeout_s - result.waited_s
        if left <= 0:
            stop_said = (
                ""
                if ran.code == 0 and ran.ran
                else f" ({' '.join(cmds.stop)} answered: {result.output.strip()[-200:]!r})"
            )
            result.detail = (
                f"still there after {ms.timeout_s}s{stop_said}: {' '.join(cmds.poll)} last said "
                f"{result.last_poll!r}; check the provider's console that {box.instance_id or box.name} is "
                "gone and not billing"
            )
            return result
        await sleep(min(ms.poll.interval_s, left))


def require_stopped(result: MeterResult) -> None:
    """Raise unless the meter is proven stopped (or the user confirmed the manual steps)."""
    if result.mode == "manual" and not result.manual_confirmed:
        raise ControllerError(
            "the meter is NOT stopped: do the console steps shown above, then confirm with "
            "`boxwarden down NAME --confirm NAME --meter-stopped` (or type done at the prompt in a terminal)"
        )
    if result.mode == "argv" and not result.gone:
        raise ControllerError(f"the meter may still be running: {result.detail}")
