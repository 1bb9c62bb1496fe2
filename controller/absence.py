"""Absence is proven, not inferred: `down --box-gone` closes a box only when the provider says it is
gone, or when no link reaches its host at all. A sidecar that does not answer proves nothing by
itself: on a host that still answers it is "sidecar dead, host up" (the box and its disk are there,
maybe still writing), and the way out is `up` again, then the usual pull and `down`.

The host is asked over a connection of its own (never a ControlMaster that may outlive the box): a
login that runs means the host answers, and so does a refused login (something is there to refuse
it). Only a connection that cannot be made (refused, timed out, no route, no such name, another
host key) counts as unreachable.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from controller import meterstop
from controller.profiles import Profile
from controller.ssh import argv as sshargv
from controller.state import Box

HOST_TIMEOUT_S = 40.0  # past ssh's own ConnectTimeout: a login that hangs after connecting answered
ANSWERED = ("Permission denied", "Too many authentication failures", "Authentication failed")


@dataclass(frozen=True)
class Absence:
    """Whether the box is proven gone, and by what (or why not)."""

    proven: bool
    how: str


def _up_again(box: Box, said: str) -> Absence:
    return Absence(
        False,
        f"sidecar dead, host up: {said}. The box is not gone and may still hold or write checkpoints: run "
        f"`boxwarden up {box.name}` (with its --profile and --host) to start its sidecar again, then pull, "
        f"verify and `boxwarden down {box.name} --confirm {box.name}`",
    )


async def prove(box: Box, profile: Profile) -> Absence:
    """Asked now: the provider first, then the host itself."""
    gone, said = await meterstop.provider_says_gone(profile, box)
    if gone:
        return Absence(True, f"the provider says it is gone ({said})")
    provider = f"; the provider does not say it is gone ({said})"
    if not box.host:
        return _up_again(box, "the box is this machine, which answers" + provider)
    reached, detail = await host_answers(box)
    if reached:
        return _up_again(box, f"{box.host} answers over SSH ({detail})" + provider)
    return Absence(True, f"no link reaches {box.host} ({detail})")


async def host_answers(box: Box) -> tuple[bool, str]:
    """Does the box's host answer a login of its own (no ControlMaster)? (answers, what ssh said)."""
    dest = sshargv.Destination(box.host, box.ssh_options, box.ssh_config)
    argv = [*dest.base(), "-o", "ControlMaster=no", "-o", "ControlPath=none", "-T", "--", box.host, "true"]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        cwd="/",
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), HOST_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return True, f"a login did not finish within {HOST_TIMEOUT_S:.0f}s: something answered the connection"
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    said = " ".join(err.decode(errors="replace").split())[-300:]
    if proc.returncode == 0:
        return True, "a login ran"
    if proc.returncode != 255 or any(a in said for a in ANSWERED):
        return True, f"it refused or failed the login: {said or f'exit {proc.returncode}'}"
    return False, said or "ssh could not connect"
