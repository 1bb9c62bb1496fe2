"""What is mounted on and inside a watched dir, so that a mount that hides files is seen.

A filesystem mounted over a watched dir or over a directory above it (the workdir), swapped for
another, or taken away after the box came up shows the sidecar another tree than the one it was
watching: what the other one holds is hidden from every check. So is whatever lies under a mount
point inside a watched dir. Both are told from /proc/self/mountinfo, which lists every mount point,
so a bind mount from the same filesystem (same device) is seen as well as a tmpfs.

A watched dir's *signature* is its device and the mounts stacked at its path and at every
directory above it, each as its device and root within its filesystem: what the mount shows, so a
bind mount swapped for another is told apart, and the same one mounted back matches again (mount
ids are not compared: the kernel reuses them). The first sidecar of a ledger records each
signature with the boot id; a later sidecar in the same boot compares against that record (so a
mount made while no sidecar ran is seen too), and after a reboot, when device numbers of
filesystems without a disk of their own are new, records afresh.
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterable
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"
BOOT_ID = "/proc/sys/kernel/random/boot_id"

Mounts = dict[str, list[str]]
"""Mount point path -> the mounts stacked there, in mountinfo's order, each "MAJOR:MINOR:ROOT"."""


def read(mountinfo: str = MOUNTINFO) -> Mounts | None:
    """Every mount point and the mounts stacked there; None if mountinfo cannot be read."""
    try:
        with open(mountinfo, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return parse(data)


class Watch:
    """This process's mount table, kept open so that a change is seen without reading it again:
    the kernel marks /proc/self/mountinfo for poll() (POLLPRI) when a mount comes or goes, and
    reading it clears the mark. A walk asks `changed()` (one syscall) before it looks at each
    directory, so that a mount made after the walk began is not entered either: a network or FUSE
    mount that stopped answering hangs whoever looks at it. Without mountinfo, nothing changes."""

    def __init__(self, mountinfo: str = MOUNTINFO) -> None:
        self._poll = select.poll()
        try:
            self._fd: int | None = os.open(mountinfo, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None
        else:
            self._poll.register(self._fd, select.POLLPRI | select.POLLERR)

    def read(self) -> Mounts | None:
        if self._fd is None:
            return None
        chunks = []
        try:
            os.lseek(self._fd, 0, os.SEEK_SET)
            while True:
                chunk = os.read(self._fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:
            return None
        return parse(b"".join(chunks))

    def changed(self) -> bool:
        return self._fd is not None and bool(self._poll.poll(0))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse(data: bytes) -> Mounts:
    """The mount points of a mountinfo text, and the mounts stacked at each."""
    points: Mounts = {}
    for line in data.splitlines():
        fields = line.split(b" ", 5)
        if len(fields) < 5 or not fields[0].isdigit():
            continue
        mount = f"{os.fsdecode(fields[2])}:{unescape(os.fsdecode(fields[3]))}"
        points.setdefault(unescape(os.fsdecode(fields[4])), []).append(mount)
    return points


def unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def fs_path(path: str, points: Mounts) -> tuple[str, str] | None:
    """Where `path` (as a process with these mounts names it) lies: (MAJOR:MINOR of its
    filesystem, its path within that filesystem), through the top mount at the longest mount
    point above it. A bind mount of a watched dir's subdirectory, anywhere and in any mount
    namespace, lies inside the watched dir by this measure. None if no mount point is above it."""
    best = ""
    for point in points:
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best = point
    if not best:
        return None
    major, minor, root = points[best][-1].split(":", 2)
    rest = path[len(best) :].strip("/")
    inner = root.rstrip("/") + "/" + rest if rest else root
    return f"{major}:{minor}", inner or "/"


def boot_id() -> str:
    try:
        with open(BOOT_ID, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def signatures(roots: Iterable[Path], points: Mounts | None) -> dict[Path, str]:
    """Each root's signature now: "DEV|PATH=MOUNT,MOUNT|..." over the root and the directories above it
    that are mount points. A root that cannot be looked at is left out (the walk reports it).
    Without mountinfo only the device is there."""
    out: dict[Path, str] = {}
    for root in roots:
        try:
            dev = os.lstat(root).st_dev
        except OSError:
            continue
        parts = [str(dev)]
        if points is not None:
            for here in (root, *root.parents):
                ids = points.get(str(here))
                if ids:
                    parts.append(f"{here}={','.join(ids)}")
        out[root] = "|".join(parts)
    return out


def changed(then: str, now: str) -> str | None:
    """Why a root's signature `now` is not the one recorded when the box came up; None if it is."""
    if then == now:
        return None
    if then.split("|", 1)[0] != now.split("|", 1)[0]:
        return "it is on another filesystem than when the box came up"
    return (
        "a filesystem was mounted on it or on a directory above it, swapped or taken away since the box "
        f"came up (mounts then: {_shown(then)}; now: {_shown(now)})"
    )


def _shown(signature: str) -> str:
    return ", ".join(signature.split("|")[1:]) or "none"


def inside(root: Path, points: Mounts | None) -> list[str]:
    """Mount points strictly under `root` (directories or files, any filesystem), by path."""
    if points is None:
        return []
    prefix = str(root).rstrip("/") + "/"
    return sorted(p for p in points if p.startswith(prefix) and p != str(root))
