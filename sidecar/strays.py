"""Strays: processes outside every job's tree that work where the jobs work.

A job's tree (sidecar.proctree) is found by PID, session, environment tag, reparenting and the
orphans it was given. A job can still hand work to a process none of these reach: a session in a
tmux server that was already running, `at`, an orphan of a fork made while the sidecar was down, or
the user's own trainer started by hand (`nohup python train.py &` in the workdir). What such a
process rarely hides is where it works.

A stray is a live process, not a member of any job, not the sidecar's own and not the caller's
(the controller running `down` on this machine, the other members of its pipeline, and an ancestor
that only waits for them, such as its shell), whose working directory is the workdir, a job's cwd
or a watched dir, or lies under one (compared by path and, for bind-mount aliases and other mount
namespaces, by device and inode), or which holds any file or directory there open (a deleted one
too, where its directory was: an O_TMPFILE may still be linked in; or registered with an io_uring,
its fd closed), or maps one into memory (a MAP_SHARED mapping writes with its fd closed; an
executable or library run from the workdir ties the process to it too), or watches a directory
there through inotify or fanotify. Every thread counts: one that unshared its cwd or its file table
is looked at too, and so does a process whose main thread exited while others run on.
The rule asks nothing else, so a shell left standing in the workdir (other than the one running
`down`) holds the gate too: its line says to leave.
Processes whose /proc entries cannot be read (other users') are not strays: their open files still
show through sidecar.openfiles, and a process that works elsewhere and holds nothing open there is
beyond what /proc can tie to a job (the README says so).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass

from sidecar import mounts, proctree
from sidecar.compat import SLOTS
from sidecar.openfiles import (
    DELETED,
    file_tables,
    mapped_files,
    read_fds,
    read_maps,
    ring_files,
    tasks,
    watch_marks,
)

_MAX_DEPTH = 4096  # directories above a working directory that are looked at
TOO_DEEP = "(a path longer than PATH_MAX)"
COMMAND_SHOWN = 240  # characters of a stray's command line in a refusal: enough to tell what it is


@dataclass(frozen=True, **SLOTS)
class Caller:
    """Who asks (see pb.Caller): PIDs as numbered in the caller's PID namespace, with their start
    times, that namespace's inode and the caller's boot id."""

    pids: tuple[int, ...] = ()
    start_ticks: tuple[int, ...] = ()
    pid_ns: int = 0
    boot_id: str = ""


def believed(caller: Caller | None, table: proctree.ProcTable) -> list[int]:
    """The caller's PIDs that name the caller's processes here: none unless the caller counts PIDs
    in this PID namespace on this boot (a controller in a container or another `unshare -p` would
    otherwise exempt whatever process here has its number), and only while each start time
    matches (a number reused since)."""
    if caller is None or not caller.pids or len(caller.start_ticks) != len(caller.pids):
        return []
    try:
        own_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return []
    if caller.pid_ns != own_ns or caller.boot_id != mounts.boot_id():
        return []
    out = []
    for i, pid in enumerate(caller.pids):  # as many start times (checked above)
        p = table.procs.get(pid)
        if p is None or p.start_ticks != caller.start_ticks[i]:
            break
        out.append(pid)
    return out


@dataclass(frozen=True, **SLOTS)
class Stray:
    pid: int
    command: str
    cwd: str
    started_at_ns: int
    why: str  # "works in DIR" or "holds PATH open"


class _Roots:
    """The directories a stray may not work in, by real path and by (device, inode)."""

    def __init__(self, roots: Iterable[str], watched: Iterable[str] = (), aside: Iterable[str] = ()) -> None:
        self.paths = sorted({os.path.realpath(r) for r in roots if r})
        self._aside = [os.path.realpath(a) for a in aside if a]
        self._watched = [os.path.realpath(w) for w in watched if w]
        self._dirs: set[tuple[int, int]] | None = None
        self.ids: set[tuple[int, int]] = set()
        for r in self.paths:
            try:
                st = os.stat(r)
            except OSError:
                continue
            self.ids.add((st.st_dev, st.st_ino))
        self.devs = {dev for dev, _ in self.ids}
        ours = mounts.read()
        found = (mounts.fs_path(r, ours) for r in self.paths) if ours is not None else ()
        self.inner = [f for f in found if f is not None]  # each root's place in its filesystem
        self._ns_mounts: dict[int, mounts.Mounts | None] = {}
        self._places: dict[tuple[int, int, int, str], bool] = {}  # see holds_place

    def set_aside(self, path: str) -> bool:
        """Is the file `path` under a directory that is never a stray's work (the state of this
        machine's boxes: another box's sidecar holds its ledger and log there, maps its venv)?"""
        return any(path == a or path.startswith(a.rstrip("/") + "/") for a in self._aside)

    def by_path(self, path: str) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in self.paths)

    def holds_dir(self, link: str, path: str, pid: int) -> bool:
        """The directory behind `link` (a /proc/PID/task/TID cwd or root), which reads as `path`
        here ("" when it cannot be read: deeper than PATH_MAX), is a root or under one, however it
        is spelled: by that path, or by the device and inode of the directory and each one above
        it, looked at through the link, which leads into the process's own mount namespace (a
        container that bind-mounted a watched dir works in it under a path that does not exist
        here), or by where the path lies in its filesystem, read from the process's mountinfo (a
        bind mount of a watched dir's subdirectory: ".." from its root leaves the mount, never
        passing the watched dir). `pid` is the process's."""
        if path and self.by_path(path):
            return True
        try:
            st = os.stat(link)
        except OSError:
            return False
        if self._walk(link, st):
            return True
        # On a watched dir's filesystem at all? (saves a mountinfo lookup per open file)
        return bool(path) and st.st_dev in self.devs and self._by_mounts(path, pid)

    def holds_place(self, task: str, path: str, pid: int) -> bool:
        """holds_dir for `path` as the task `task` (of process `pid`) names it from its root: the
        answer is the same for every process with that root in that mount namespace, so it is
        asked once per scan (a thousand processes map the same hundred library directories)."""
        try:
            root = os.stat(f"{task}/root")
            ns = os.stat(f"/proc/{pid}/ns/mnt").st_ino
        except OSError:
            return self.holds_dir(f"{task}/root{path}", path, pid)
        key = (root.st_dev, root.st_ino, ns, path)
        if key not in self._places:
            self._places[key] = self.holds_dir(f"{task}/root{path}", path, pid)
        return self._places[key]

    def _walk(self, link: str, st: os.stat_result) -> bool:
        """Up from `link` (whose stat is `st`) through "..", by device and inode."""
        here = link
        seen: tuple[int, int] | None = None
        for _ in range(_MAX_DEPTH):
            ident = (st.st_dev, st.st_ino)
            if ident in self.ids:
                return True
            if ident == seen:  # ".." of its root is its root
                return False
            seen = ident
            here += "/.."
            try:
                st = os.stat(here)
            except OSError:
                return False
        return True  # deeper than any walk goes: it cannot be placed, so it counts (fail closed)

    def holds_inode(self, dev: int, ino: int) -> bool:
        """Is (dev, ino) a root, or a directory inside a watched dir (those are walked once per
        scan, and only when some process watches an inode on a root's filesystem)?"""
        if (dev, ino) in self.ids:
            return True
        if dev not in self.devs:
            return False
        if self._dirs is None:
            self._dirs = set()
            for top in self._watched:
                for d, _subdirs, _files in os.walk(top):
                    try:
                        st = os.lstat(d)
                    except OSError:
                        continue
                    self._dirs.add((st.st_dev, st.st_ino))
        return (dev, ino) in self._dirs

    def _by_mounts(self, path: str, pid: int) -> bool:
        if not self.inner:
            return False
        try:
            ns = os.stat(f"/proc/{pid}/ns/mnt").st_ino
        except OSError:
            return False
        if ns not in self._ns_mounts:  # one read per mount namespace and scan
            self._ns_mounts[ns] = mounts.read(f"/proc/{pid}/mountinfo")
        points = self._ns_mounts[ns]
        found = mounts.fs_path(path, points) if points else None
        if found is None:
            return False
        dev, inner = found
        return any(dev == d and (inner == r or inner.startswith(r.rstrip("/") + "/")) for d, r in self.inner)


@dataclass(**SLOTS)
class Progress:
    """The process a scan is looking at now (so a scan stuck in the kernel can be named)."""

    pid: int = 0


def stuck_on(pid: int, seconds: float) -> Stray:
    """The refusal for a process a scan could not finish looking at."""
    why = (
        f"could not be looked at: a look at its working directory or open files has not returned "
        f"for over {seconds:.0f}s (a network or FUSE mount that stopped answering?), so nothing "
        "shows that it does not work where the jobs work"
    )
    return Stray(pid, _command(pid), "?", 0, why)


def find(
    table: proctree.ProcTable,
    *,
    roots: Iterable[str],
    exempt: set[int],
    caller: Caller | None = None,
    progress: Progress | None = None,
    watched: Iterable[str] = (),
    aside: Iterable[str] = (),
) -> list[Stray]:
    """Strays in `table`. `exempt`: the sidecar and its own children, and every job member.
    `caller`: the controller's process then its ancestors (a local box; as far as `believed`): the
    first is not a stray, nor are the other members of its `pipeline`
    (its own children, none of which works in a watched dir, are: a process the shell started
    before it exec'd the controller is the controller's child too), nor is an ancestor whose every
    thread waits for a child and whose one live child is the next on the way to the controller (a
    shell running the command that runs `down`): one that runs on meanwhile (a notebook kernel's
    training thread, an event loop) or has another child to wait for (a training thread waiting
    for its eval step) is looked at like any other."""
    callers = believed(caller, table)
    skip = set(exempt)
    if callers:
        skip.add(callers[0])
        kids = table.children()
        others = pipeline(callers, table, kids)
        skip |= others
        for i in range(1, len(callers)):  # (zip's strict= is not in 3.9)
            pid, child = callers[i], callers[i - 1]
            # It waits for the one child that leads to the controller (and the shell for the rest
            # of its pipeline), and for nothing else: a thread that waits for an eval step it
            # started runs on (and saves) when that ends.
            live = [k for k in kids.get(pid, []) if k in table.procs and not table.procs[k].zombie]
            if [k for k in live if k not in others] == [child] and _only_waits(pid):
                skip.add(pid)
    where = _Roots(roots, watched, aside)
    out = []
    for p in table.procs.values():
        if p.pid in skip or p.zombie or p.kernel_thread:
            continue
        if progress is not None:
            progress.pid = p.pid
        cwd = _cwd(p.pid)
        if cwd is None:  # gone, or not ours to look at
            continue
        why = _works_there(p.pid, where)
        if why:
            out.append(Stray(p.pid, _command(p.pid), cwd, ticks_to_unix_ns(p.start_ticks), why))
    return sorted(out, key=lambda s: s.pid)


def pipeline(callers: list[int], table: proctree.ProcTable, kids: dict[int, list[int]]) -> set[int]:
    """The other members of the command line the caller is part of (`boxwarden down NAME | tail`):
    its shell's other children in its process group, joined to it by pipes (one to the next), when
    the shell made that group for this one command line (job control: the caller's group is not
    the shell's). Without job control (a script, `sh -c`) every command shares the shell's group,
    and a `python train.py &` there is looked at like any other process; so is one a program put
    in a group with the caller without a pipe between them, whatever a member started (only the
    shell's own children are members), and the caller's own children."""
    if len(callers) < 2:
        return set()
    me, shell = table.procs.get(callers[0]), table.procs.get(callers[1])
    if me is None or shell is None or me.pgrp == shell.pgrp:
        return set()
    left = {
        k
        for k in kids.get(shell.pid, [])
        if k != me.pid and k in table.procs and table.procs[k].pgrp == me.pgrp and not table.procs[k].zombie
    }
    pipes = {k: _pipes(k) for k in left}
    joined = _pipes(me.pid)
    members: set[int] = set()
    while True:
        found = {k for k in left if pipes[k] & joined}
        if not found:
            return members
        members |= found
        left -= found
        for k in found:
            joined |= pipes[k]


def _pipes(pid: int) -> set[str]:
    """The pipes process `pid` holds open ("pipe:[inode]"); none where its fds cannot be read."""
    out: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("pipe:["):
            out.add(target)
    return out


def _tasks(pid: int) -> list[str]:
    """The process's thread ids, the main thread's first; [] if it is gone or not ours to see."""
    try:
        return tasks(str(pid))
    except OSError:
        return []


def _cwd(pid: int) -> str | None:
    """The process's working directory: its main thread's, or (when the main thread has exited
    and others run on) that of the first thread that has one; TOO_DEEP for one whose path is
    longer than PATH_MAX (it is looked at all the same)."""
    for tid in _tasks(pid):
        try:
            return os.readlink(f"/proc/{pid}/task/{tid}/cwd")
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                return TOO_DEEP
            continue
    return None


def _only_waits(pid: int) -> bool:
    """Whether every thread of `pid` is blocked waiting for a child (wchan do_wait). False when
    the kernel does not say (no wchan): the process is then looked at like any other."""
    tids = _tasks(pid)
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan", "rb") as f:
                if f.read().strip() != b"do_wait":
                    return False
        except OSError:
            return False
    return bool(tids)


def _works_there(pid: int, where: _Roots) -> str:
    """Why process `pid` works where the jobs work, "" if it does not. Every thread is looked at:
    a thread that unshared its filesystem context (CLONE_FS) has its own cwd and root, and one that
    unshared its file table (CLONE_FILES) its own open files."""
    seen_dirs: set[tuple[str, str]] = set()
    seen_files: set[str] = set()
    for tid in _tasks(pid):  # the main thread first
        task = f"/proc/{pid}/task/{tid}"
        own_fs = tid == str(pid) or not proctree.shares(pid, int(tid), proctree.KCMP_FS)
        for kind, what in (("cwd", "works in"), ("root", "has its root in")) if own_fs else ():
            try:
                path = os.readlink(f"{task}/{kind}")
            except OSError as e:
                if e.errno != errno.ENAMETOOLONG:
                    continue
                path = ""  # deeper than PATH_MAX: looked at through the link alone
            if path == "" or (kind, path) not in seen_dirs:
                seen_dirs.add((kind, path))
                if where.holds_dir(f"{task}/{kind}", path, pid):
                    return f"{what} {path or TOO_DEEP}{_thread(pid, tid)}"
    for tid in file_tables(str(pid)):  # one thread per file table: most threads share one
        task = f"/proc/{pid}/task/{tid}"
        try:
            table = read_fds(str(pid), task=tid, deleted=True)
            for fd, target in table.paths:
                if target and target in seen_files:
                    continue
                seen_files.add(target)
                if _named_there(where, pid, task, target, seen_dirs, itself=f"{task}/fd/{fd}"):
                    return f"holds {target or TOO_DEEP} open{_thread(pid, tid)}"
            for dev, ino in watch_marks(str(pid), table.notify, task=tid):
                if where.holds_inode(dev, ino):
                    return f"watches a directory there for changes (inotify or fanotify){_thread(pid, tid)}"
            registered, unsure = ring_files(str(pid), table.rings, task=tid)
            for target in registered:
                if _named_there(where, pid, task, target, seen_dirs, itself=f"{task}/root{target}"):
                    return f"holds {target} open through an io_uring"
            if unsure:
                return "holds an io_uring whose registered files could not be read (busy?)"
        except OSError:  # gone, or not ours to look at
            continue
    return _maps_there(pid, where, seen_dirs)


def _thread(pid: int, tid: str) -> str:
    """How a reason names the thread it found: nothing for the main thread."""
    return "" if tid == str(pid) else f" (thread {tid})"


def _maps_there(pid: int, where: _Roots, seen: set[tuple[str, str]]) -> str:
    """Why process `pid` maps a file from where the jobs work into memory ("" if it does not): its
    executable, a library, or a file it mapped and closed (a MAP_SHARED mapping writes into the
    file with no fd open). Threads share one memory map; a zombie main thread has none, so the
    first thread that has one answers."""
    try:
        tid, maps = read_maps(str(pid))
    except OSError:  # gone, or not ours to look at
        return ""
    task = f"/proc/{pid}/task/{tid}"
    for path in mapped_files(maps):
        if _named_there(where, pid, task, path, seen):
            return f"maps {path} into memory"
    return ""


def _named_there(
    where: _Roots, pid: int, task: str, target: str, seen: set[tuple[str, str]], *, itself: str = ""
) -> bool:
    """Whether the file `target` names, as the kernel spelled it for the task `task`, lies where the
    jobs work, however it is spelled. A directory counts by itself, a file where its directory is
    (a deleted file, or an O_TMPFILE that linkat() can still put in place, too). Compared by path,
    then by device and inode: through `itself` (a link to the file: an fd; a directory has ".."
    to walk up) where there is one, and through the task's root for its directory (/proc/.../root
    leads into its mount namespace: a container's bind mount of the workdir at a path of its own,
    or a bind-mount alias here)."""
    gone = target.endswith(DELETED)
    path = target[: -len(DELETED)] if gone else target
    if path and where.set_aside(path):
        return False  # the boxes' own state: a ledger, a log, a venv's library
    # A live name may end in DELETED too (a watched dir named "ckpt (deleted)"): both spellings.
    if where.by_path(path) or (gone and where.by_path(target)):
        return True
    if itself and where.holds_dir(itself, target, pid):  # by device and inode, whatever its name
        return True
    if not path:
        return False  # its path could not be read: nothing more to go by
    parent = os.path.dirname(path)
    if ("parent", parent) in seen:
        return False
    seen.add(("parent", parent))
    return where.holds_place(task, parent, pid)


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
        f"pid {x.pid} ({x.command[:COMMAND_SHOWN]}) {x.why}, outside every job's process tree: it may be "
        "writing for one (a tmux session, `at`, a trainer started by hand); stop it, or if it is only your "
        "shell, leave that directory"
    )
