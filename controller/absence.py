"""Absence is proven, not inferred: `down --box-gone` closes a box only when the provider says it is
gone, or, where no provider can be asked, when no link reaches its host at all. A sidecar that does
not answer proves nothing by itself: on a host that still answers it is "sidecar dead, host up"
(the box and its disk are there, maybe still writing), and the way out is `up` again, then the
usual pull and `down`. A provider that still lists the instance outweighs a host out of reach (a
cut link, a stopped instance): it is gone once the provider says so.

The host is asked over a connection of its own (never a ControlMaster that may outlive the box).
Only a connection that cannot be made at all counts as unreachable (refused, timed out, no route,
no such name: UNREACHABLE below); anything else means something answered at the box's address: a
login that runs, a refused login, an sshd that drops the connection before the login (too many
starting up, a box under load), another host key (another machine there, the box maybe elsewhere).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from controller import meterstop
from controller.profiles import Profile
from controller.ssh import argv as sshargv
from controller.state import Box

HOST_TIMEOUT_S = 40.0  # past ssh's own ConnectTimeout: a login that hangs after connecting answered
UNREACHABLE = (
    "Connection refused",
    "Connection timed out",
    "Operation timed out",
    "No route to host",
    "Network is unreachable",
    "Could not resolve hostname",
    "Name or service not known",
    "nodename nor servname",
)
"""What ssh says when it could not connect at all; whatever else it says, something answered."""


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
    """Asked now: the provider first, then (where it cannot be asked) the host itself."""
    word, said = await meterstop.provider_says(profile, box)
    if word == meterstop.GONE:
        return Absence(True, f"the provider says it is gone ({said})")
    if word == meterstop.LISTED:
        return Absence(
            False,
            f"the provider still lists {box.instance_id or box.name} ({said}): it is not gone, only out of "
            "reach or stopped. If it was preempted or destroyed, wait until the provider no longer lists "
            f"it (or destroy it there); if it is only out of reach, `boxwarden up {box.name}` once it "
            "answers",
        )
    if not box.host:
        return _up_again(box, f"the box is this machine, which answers; {said}")
    reached, detail = await host_answers(box)
    if reached:
        return _up_again(box, f"something answers at {box.host} over SSH ({detail}); {said}")
    return Absence(True, f"no link reaches {box.host} ({detail}); {said}")


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
    if proc.returncode == 255 and any(u.lower() in said.lower() for u in UNREACHABLE):
        return False, said
    return True, said or f"ssh exit {proc.returncode}"
