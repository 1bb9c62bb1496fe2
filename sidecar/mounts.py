"""What is mounted at a watched dir, so that a filesystem mounted over it (or taken away from it)
after the box came up is seen: either one hides what the other holds from every check.

A watched dir's mark is its device and the number of mounts stacked at its path (from
/proc/self/mountinfo, which a same-filesystem bind mount changes even though the device does not).
The first sidecar of a ledger records each watched dir's mark; every walk compares.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"


def mount_counts(mountinfo: str = MOUNTINFO) -> Counter[str] | None:
    """How many mounts are stacked at each mount point; None if mountinfo cannot be read."""
    try:
        with open(mountinfo, "rb") as f:
            data = f.read()
    except OSError:
        return None
    counts: Counter[str] = Counter()
    for line in data.splitlines():
        fields = line.split(b" ", 5)
        if len(fields) >= 5:
            counts[unescape(os.fsdecode(fields[4]))] += 1
    return counts


def unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and len(field[i + 1 : i + 4]) == 3:
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def marks(roots: Iterable[Path], counts: Counter[str] | None) -> dict[Path, str]:
    """Each root's mark now ("device:mounts"); a root that cannot be looked at is left out (the
    walk reports it). Without mountinfo the count is "?": only the device is compared then."""
    out: dict[Path, str] = {}
    for root in roots:
        try:
            dev = os.lstat(root).st_dev
        except OSError:
            continue
        out[root] = f"{dev}:{'?' if counts is None else counts.get(str(root), 0)}"
    return out


def changed(recorded: str, now: str) -> str | None:
    """Why a root's mark `now` is not the one recorded when the box came up; None if it is."""
    dev_then, _, n_then = recorded.partition(":")
    dev_now, _, n_now = now.partition(":")
    if dev_then != dev_now:
        return "it is on another filesystem than when the box came up (a mount over it, or one taken away)"
    if "?" not in (n_then, n_now) and n_then != n_now:
        return f"{n_then} mounts were stacked on it when the box came up, {n_now} now"
    return None
