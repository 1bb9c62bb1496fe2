"""Absence is proven, not inferred: `down --box-gone` closes a box only when the provider says it is
gone, or, where no provider can be asked, when no link from here reaches its host at all AND the
user says the provider's console shows it gone (`--console-shows-gone`). A sidecar that does not
answer proves nothing by itself: on a host that still answers it is "sidecar dead, host up" (the box
and its disk are there, maybe still writing), and the way out is `up` again, then the usual pull and
`down`. A provider that still lists the instance outweighs a host out of reach (a cut link, a
stopped instance): it is gone once the provider says so.

A profile that has a poll command must answer it: a poll that could not run (or was killed) proves
nothing either way, and the host is not asked instead (this machine's own network may be what is
down).

The host is asked over a connection of its own (never a ControlMaster that may outlive the box).
Only ssh's own word that it could not connect to the box's address at all counts as no link:
`connect to host <its HostName> port <its Port>: refused | timed out`, or a name that has no
address. Even that is network evidence only: a live box whose sshd is stopped, or a firewall
(this machine's or the box's), looks the same from here, so it never closes a box without the
user's word from the console. What this machine says when its own network is down (no route out,
a network unreachable, a resolver that does not answer) tells nothing either way: this machine
cannot tell. Anything else means something answered there: a login that runs, a refused login, an
sshd that drops the connection or never sends its banner (a box under load), another host key
(another machine there, the box maybe elsewhere). A box reached through a jump host or a proxy
command is never proven gone this way: a hop that cannot be reached says nothing of the box.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from controller import meterstop
from controller.profiles import Profile
from controller.ssh import argv as sshargv
from controller.state import Box

HOST_TIMEOUT_S = 40.0  # past ssh's own ConnectTimeout: a login that hangs after connecting answered
CONNECT_FAILED = ("Connection refused", "Connection timed out", "Operation timed out")
"""What ssh says after `connect to host H port P: ` when it could not connect to that address at all."""
OWN_NETWORK = ("Network is unreachable", "No route to host")
"""What ssh says after `connect to host H port P: ` when this machine has no way there: its own
network may be down (no route out, a gateway of its own that does not answer). Says nothing of the box."""
NO_SUCH_NAME = ("Name or service not known", "No address associated with hostname",
                "nodename nor servname provided")  # fmt: skip
"""What ssh says after `Could not resolve hostname H: ` when the name is known to have no address;
never "Temporary failure in name resolution" (this machine's resolver out of reach)."""
RESOLVER_DOWN = ("Temporary failure in name resolution",)

ANSWERS, NO_LINK, CANNOT_TELL = "answers", "no-link", "cannot-tell"
"""What asking the host over SSH found: something answered there; no connection to its address
could be made at all; or this machine cannot tell (its own network or resolver failing)."""
HOST_UP = "SIDECAR_DEAD_HOST_UP"
"""--box-gone, but something answers where the box is (its host, or this machine for a local box)."""
UNPROVEN = "GONE_UNPROVEN"
"""--box-gone, but nothing proves the box gone: the provider lists it or cannot be asked, this
machine cannot tell, or no link reaches the host and the user has not said the console shows it gone."""


@dataclass(frozen=True)
class Absence:
    """Whether the box is proven gone, and by what (or why not)."""

    proven: bool
    how: str
    code: str = ""  # when not proven: HOST_UP or UNPROVEN


def _up_again(box: Box, said: str) -> Absence:
    return Absence(
        False,
        f"sidecar dead, host up: {said}. The box is not gone and may still hold or write checkpoints: run "
        f"`boxwarden up {box.name}` (with its --profile and --host) to start its sidecar again, then pull, "
        f"verify and `boxwarden down {box.name} --confirm {box.name}`",
        HOST_UP,
    )


async def prove(box: Box, profile: Profile, *, console_shows_gone: bool = False) -> Absence:
    """Asked now: the provider first, then (where it cannot be asked) the host itself, and the
    user's word from the console (`console_shows_gone`)."""
    word, said = await meterstop.provider_says(profile, box)
    if word == meterstop.GONE:
        return Absence(True, f"the provider says it is gone ({said})")
    if word == meterstop.UNANSWERED:
        return Absence(
            False,
            f"the provider could not be asked ({said}): nothing says the box is gone. Ask again once it "
            "answers; if the box is only out of reach, `boxwarden up` it once it answers",
            UNPROVEN,
        )
    if word == meterstop.LISTED:
        return Absence(
            False,
            f"the provider's poll does not say {box.instance_id or box.name} is gone ({said}): it may be "
            "only out of reach or stopped. If it was preempted or destroyed, wait until the provider no "
            f"longer lists it (or destroy it there); if it is only out of reach, `boxwarden up {box.name}` "
            "once it answers",
            UNPROVEN,
        )
    if not box.host:
        return _up_again(box, f"the box is this machine, which answers; {said}")
    kind, detail = await host_reach(box)
    if kind == ANSWERS:
        return _up_again(box, f"something answers at {box.host} over SSH ({detail}); {said}")
    if kind == CANNOT_TELL:
        return Absence(
            False,
            f"this machine cannot tell whether {box.host} is there: ssh says {detail!r}, which is what this "
            "machine says when its own network or resolver is down. Nothing says the box is gone: check "
            "this machine's network (can it reach other hosts?), then ask again",
            UNPROVEN,
        )
    seen = f"no link from here reaches {box.host} ({detail})"
    if console_shows_gone:
        return Absence(
            True, f"{seen}, and you say {profile.name}'s console shows it gone (--console-shows-gone)"
        )
    n = box.name
    return Absence(
        False,
        f"{seen}; {said}. That does not tell a gone box from a live one this machine cannot reach (its "
        f"sshd stopped, a firewall, this machine's own network). Look in {profile.name}'s console: if it "
        f"shows {box.instance_id or n} gone (destroyed, released; not stopped), say so: add "
        f"--console-shows-gone; if it lists it, the box is not gone: `boxwarden up {n}` once it answers",
        UNPROVEN,
    )


async def host_reach(box: Box) -> tuple[str, str]:
    """Does the box's host answer a login of its own (no ControlMaster)? (ANSWERS, NO_LINK or
    CANNOT_TELL, what ssh said)."""
    dest = sshargv.Destination(box.host, box.ssh_options, box.ssh_config)
    where = await _resolved(dest)
    if where.get("proxyjump", "none") != "none" or where.get("proxycommand", "none") != "none":
        hop = where.get("proxyjump") or where.get("proxycommand")
        return ANSWERS, f"it is reached through {hop}: a hop out of reach says nothing of the box"
    argv = [*dest.base(), "-o", "ControlMaster=no", "-o", "ControlPath=none", "-T", "--", box.host, "true"]
    code, said = await _ssh(argv)
    if code is None:
        return (
            ANSWERS,
            f"a login did not finish within {HOST_TIMEOUT_S:.0f}s: something answered the connection",
        )
    if code == 0:
        return ANSWERS, "a login ran"
    if code == 255:
        kind = reach_of(said, where.get("hostname", box.host), where.get("port", "22"), box.host)
        if kind != ANSWERS:
            return kind, said
    return ANSWERS, said or f"ssh exit {code}"


def reach_of(said: str, host: str, port: str, dest: str) -> str:
    """What ssh's words (exit 255) say: NO_LINK when it could not connect to `host`:`port` at all
    or its name (`host`, or `dest` as given) has no address; CANNOT_TELL when this machine's own
    network or resolver failed on the way there; ANSWERS otherwise (something answered, or the
    words are about another hop)."""

    def at_box(words: tuple[str, ...]) -> bool:
        return any(f"connect to host {host} port {port}: {w}" in said for w in words)

    def name_said(words: tuple[str, ...]) -> bool:  # (ssh names the HostName it resolves)
        return any(f"Could not resolve hostname {n}: {w}" in said for n in {host, dest} for w in words)

    if at_box(CONNECT_FAILED) or name_said(NO_SUCH_NAME):
        return NO_LINK
    if at_box(OWN_NETWORK) or name_said(RESOLVER_DOWN):
        return CANNOT_TELL
    return ANSWERS


async def _resolved(dest: sshargv.Destination) -> dict[str, str]:
    """What ssh makes of the destination (`ssh -G`): its HostName, Port, ProxyJump, ProxyCommand."""
    argv = [*dest.base(), "-G", "--", dest.dest]
    code, out = await _ssh(argv, stdout=True)
    if code != 0:
        return {}
    found: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key in ("hostname", "port", "proxyjump", "proxycommand"):
            found[key] = value.strip()
    return found


async def _ssh(argv: list[str], *, stdout: bool = False) -> tuple[int | None, str]:
    """Run ssh to its end: (exit code, what it said on stderr, or stdout with `stdout`); None when it
    outlived HOST_TIMEOUT_S (killed)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE if stdout else asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        cwd="/",
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), HOST_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None, ""
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    if stdout:
        return proc.returncode, out.decode(errors="replace")
    return proc.returncode, " ".join(err.decode(errors="replace").split())[-300:]
