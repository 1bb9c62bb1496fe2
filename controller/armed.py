"""Which `down NAME --confirm NAME --when-safe` follows a box, if any: recorded in the box's record
as the follower's pid together with what makes that pid one process (the boot and the process's
start time), so that a pid reused by another process after the follower died never shows the box
armed. The follower holds the box's lock while it follows: a command it blocks names it.
"""

from __future__ import annotations

import os
import time

from controller.state import Box, State


def process_start(pid: int) -> str:
    """`<boot id>:<start time in clock ticks>` of a live `pid` ("" when it is gone or a zombie):
    one process, whatever its pid becomes later."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open("/proc/sys/kernel/random/boot_id") as b:
            boot = b.read().strip()
    except OSError:
        return ""
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return ""
    return f"{boot}:{int(fields[19])}"


def arm(state: State, name: str) -> None:
    """Record this process as the box's follower."""
    me = os.getpid()
    state.put(state.get(name).with_(armed_pid=me, armed_start=process_start(me), armed_at_ns=time.time_ns()))


def disarm(state: State, name: str) -> None:
    """Forget this process as the box's follower (a record another follower wrote stays)."""
    now = state.find(name)
    if now is not None and now.armed_pid == os.getpid():
        state.put(now.with_(armed_pid=0, armed_start="", armed_at_ns=0))


def follower(box: Box) -> int:
    """The pid of the follower that still follows `box` (0: none does; a record without its start
    time, or whose pid is another process now, names none)."""
    if not box.armed_pid or not box.armed_start:
        return 0
    return box.armed_pid if process_start(box.armed_pid) == box.armed_start else 0


def blocking(state: State, name: str, otherwise: str) -> str:
    """The message for a command that cannot take box `name`'s lock: the follower named, with what
    ends it, when one follows the box; else `otherwise` (`{pid}` is filled by the lock's holder)."""
    box = state.find(name)
    pid = follower(box) if box is not None else 0
    if not pid or box is None:
        return otherwise
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(box.armed_at_ns / 1e9))
    return (
        f"{name} is armed: `boxwarden down {name} --confirm {name} --when-safe` (pid {pid}, since {since}) "
        "follows it and tears it down once the gate passes. Let it, or stop it first (Ctrl-C where it "
        f"runs, or `kill -INT {pid}`; a follower whose sidecar died waits for ever: stop it, run `up`, "
        "and arm it again)"
    )
