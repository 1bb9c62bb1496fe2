"""The meter stop: run the profile's verb after the gate passed, then prove the instance is gone.

A provider's "deleted" answer is not proof (RunPod and vast.ai answer before the instance is gone):
"gone" is reported only when the poll command showed it gone. A timeout is a failure that says what to
check. A manual verb prints the exact console steps and needs the user to say they did them.
Commands are argv lists filled from validated values; no shell ever sees them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from controller.errors import ControllerError
from controller.profiles import Profile, fill
from controller.state import Box

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
    detail: str = ""

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Ran:
    code: int
    output: str


async def run_argv(argv: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> Ran:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as e:
        return Ran(127, f"cannot run {argv[0]!r}: {e.strerror}")
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return Ran(-9, f"{argv[0]} did not finish within {timeout_s:.0f}s and was killed")
    assert proc.returncode is not None
    return Ran(proc.returncode, out.decode(errors="replace")[-OUTPUT_TAIL:])


async def stop_meter(
    profile: Profile,
    box: Box,
    *,
    manual_done: Callable[[str], Awaitable[bool]],
    run: Callable[[list[str]], Awaitable[Ran]] = run_argv,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> MeterResult:
    ms = profile.meter_stop
    result = MeterResult(mode=ms.mode, verb=ms.verb)
    if ms.mode == "none":
        result.gone = True
        result.detail = "nothing bills on this platform; the sidecar is stopped"
        return result
    if ms.mode == "manual":
        result.manual_confirmed = await manual_done(ms.manual)
        result.detail = "the user confirmed the console steps" if result.manual_confirmed else "not confirmed"
        return result
    values = {"instance_id": box.instance_id, "box": box.name}
    result.command = fill(ms.argv, values)
    assert ms.poll is not None  # the loader requires a poll for mode argv
    poll_argv = fill(ms.poll.argv, values)
    ran = await run(result.command)
    result.exit_code, result.output = ran.code, ran.output
    if ran.code != 0:
        result.detail = f"{' '.join(result.command)} exited {ran.code}"
        return result
    started = clock()
    while True:
        p = await run(poll_argv)
        result.polls += 1
        result.last_poll = f"exit {p.code}: {p.output.strip()[-300:]}"
        gone = p.code == ms.poll.gone_exit_code if ms.poll.gone_exit_code is not None else False
        if ms.poll.gone_stdout is not None and ms.poll.gone_stdout in p.output:
            gone = True
        result.waited_s = round(clock() - started, 3)
        if gone:
            result.gone = True
            result.detail = f"gone: {' '.join(poll_argv)} showed it after {result.polls} poll(s)"
            return result
        if result.waited_s >= ms.timeout_s:
            result.detail = (
                f"still there after {ms.timeout_s}s: {' '.join(poll_argv)} last said {result.last_poll!r}; "
                f"check the provider's console that {box.instance_id or box.name} is gone and not billing"
            )
            return result
        await sleep(ms.poll.interval_s)


def require_stopped(result: MeterResult) -> None:
    """Raise unless the meter is proven stopped (or the user confirmed the manual steps)."""
    if result.mode == "manual" and not result.manual_confirmed:
        raise ControllerError(
            "the meter is NOT stopped: do the console steps shown above, then confirm "
            "(run `down` again in a terminal, or add --meter-stopped once you did them)"
        )
    if result.mode == "argv" and not result.gone:
        raise ControllerError(f"the meter may still be running: {result.detail}")
