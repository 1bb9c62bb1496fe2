"""Strays: processes outside every job's tree that may still write for a job.

A job's tree (sidecar.proctree) is found by PID, session, environment tag and reparenting. A job can
still hand work to a process none of these reach: a session in a tmux server that was already
running (its child belongs to the server, with the server's environment), `at`, or an orphan that
cleared its environment and was reparented to init while the sidecar was down. What such a process
cannot hide is where it works: it inherits the job's working directory.

A stray is a live process, not a member of any job and not the sidecar's own, that started after
the first job of this box did (no job ever: no strays) and whose working directory is
the workdir, a job's cwd or a watched dir, or lies under one. Processes whose cwd cannot be read
(other users') are not strays: their writes still show as open files (sidecar.openfiles).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from sidecar import proctree

_PF_KTHREAD = 0x00200000


@dataclass(frozen=True, slots=True)
class Stray:
    pid: int
    command: str
    cwd: str
    started_at_ns: int


def find(
    table: proctree.ProcTable,
    *,
    roots: Iterable[str],
    since_ticks: int,
    exempt: set[int],
    caller: Iterable[int] = (),
) -> list[Stray]:
    """Strays in `table`. `exempt`: the sidecar's own tree and every job member. `caller`: the
    controller's process then its ancestors (a local box): the first with its descendants, the
    others exactly, are not strays."""
    callers = list(caller)
    skip = set(exempt)
    if callers:
        skip |= table.closure(callers[:1], set()) | set(callers[1:])
    real = [r for r in {os.path.realpath(r) for r in roots} if r]
    out = []
    for p in table.procs.values():
        if p.pid in skip or p.zombie or p.flags & _PF_KTHREAD or p.start_ticks < since_ticks:
            continue
        try:
            cwd = os.readlink(f"/proc/{p.pid}/cwd")
        except OSError:  # gone, or not ours to look at
            continue
        if any(cwd == r or cwd.startswith(r.rstrip("/") + "/") for r in real):
            out.append(Stray(p.pid, _command(p.pid), cwd, ticks_to_unix_ns(p.start_ticks)))
    return sorted(out, key=lambda s: s.pid)


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(512)
    except OSError:
        return "?"
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")[:200] or "?"


def ticks_to_unix_ns(ticks: int) -> int:
    """A start time in clock ticks since boot (field 22 of /proc/PID/stat) as Unix time."""
    try:
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, StopIteration, ValueError):
        return 0
    return btime * 1_000_000_000 + ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def stray_line(x: Stray) -> str:
    """One refusal line: what the process is, and what to do about it."""
    return (
        f"pid {x.pid} ({x.command[:80]}) works in {x.cwd} outside every job's process tree and started "
        "after a job did: it may be writing for one (a tmux session, `at`, an orphan); stop it, or if it "
        "is only yours (a shell), leave that directory"
    )
