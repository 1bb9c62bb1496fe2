"""Process tables read from /proc, and which live processes belong to a job.

A job is its whole process tree. Its members are found by PID, session and environment tag, never
by command-line text:
- its leader, while the PID still names the same process (start time unchanged);
- every process in the leader's session (the leader called setsid(), so its PID is the session
  and group id); the kernel never reuses a PID that is still some process's session or group id,
  so this cannot catch a stranger unless the PID now names a different live process;
- every process whose environment carries `BOXWARDEN_JOB_ID=<job id>`, which each job's
  descendants inherit: this finds a double-forked, setsid() escapee wherever it was reparented,
  and again after a sidecar restart;
- every process the kernel reparented to the sidecar (a child subreaper) that is not one of the
  sidecar's own children: an orphan of some job, even one that cleared its environment and left
  the session (`env -i setsid -f ...`). It is given to the newest job started before it (in doubt,
  a job stays running: fail closed);
- every descendant (by parent PID) of the above.

Scans are cheap: one read of /proc/PID/stat per process; /proc/PID/environ is read at most once
per process lifetime (cached by PID and start time) and never for kernel threads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import platform
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field

from sidecar.compat import SLOTS

logger = logging.getLogger(__name__)

TAG = "BOXWARDEN_JOB_ID"
_TAG_BYTES = TAG.encode() + b"="
_PF_KTHREAD = 0x00200000


@dataclass(frozen=True, **SLOTS)
class Proc:
    """The fields of /proc/PID/stat we use."""

    pid: int
    ppid: int
    pgrp: int
    session: int
    state: str
    flags: int
    start_ticks: int  # field 22: tells a process apart from a later one with its PID

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X")

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & _PF_KTHREAD)


def parse_stat(pid: int, stat: bytes) -> Proc | None:
    # comm (field 2) may itself hold spaces and parentheses; fields after the last ")" are fixed.
    rest = stat[stat.rfind(b")") + 2 :].split()
    if len(rest) < 20:
        return None
    return Proc(
        pid=pid,
        ppid=int(rest[1]),
        pgrp=int(rest[2]),
        session=int(rest[3]),
        state=rest[0].decode(),
        flags=int(rest[6]),
        start_ticks=int(rest[19]),
    )


def read_proc(pid: int) -> Proc | None:
    """One process's stat, or None if it is gone. A process whose main thread has exited while
    other threads run reads as a zombie in its own stat; it is alive, and is given the state of
    one of its live threads."""
    p = _read_stat(f"/proc/{pid}/stat", pid)
    if p is None or not p.zombie:
        return p
    try:
        tids = [t for t in os.listdir(f"/proc/{pid}/task") if t != str(pid)]
    except OSError:
        return p
    for tid in tids:
        thread = _read_stat(f"/proc/{pid}/task/{tid}/stat", pid)
        if thread is not None and not thread.zombie:
            return dataclasses.replace(p, state=thread.state)
    return p


def _read_stat(path: str, pid: int) -> Proc | None:
    # Raw fds, not open(): a scan reads hundreds of these, and a file object costs twice the time.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return parse_stat(pid, os.read(fd, 4096))  # one line of a few hundred bytes
    except ProcessLookupError:  # exited between open and read
        return None
    finally:
        os.close(fd)


@dataclass(**SLOTS)
class ProcTable:
    """Every process visible in /proc at one moment."""

    procs: dict[int, Proc]
    _children: dict[int, list[int]] | None = field(default=None, repr=False)

    def live(self, pid: int, start_ticks: int) -> bool:
        """Does `pid` still name the process that started at `start_ticks`, not yet a zombie?"""
        p = self.procs.get(pid)
        return p is not None and not p.zombie and p.start_ticks == start_ticks

    def children(self) -> dict[int, list[int]]:
        if self._children is None:
            kids: dict[int, list[int]] = {}
            for p in self.procs.values():
                kids.setdefault(p.ppid, []).append(p.pid)
            self._children = kids
        return self._children

    def closure(self, roots: Iterable[int], exclude: set[int]) -> set[int]:
        """The roots and all their descendants, never entering `exclude`."""
        kids = self.children()
        seen: set[int] = set(exclude)
        todo = [r for r in roots if r in self.procs]
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            todo.extend(kids.get(pid, ()))
        return seen - exclude


def scan() -> ProcTable:
    """Read every process's stat now; processes that vanish mid-scan are skipped."""
    procs: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            p = read_proc(int(name))
            if p is not None:
                procs[p.pid] = p
    return ProcTable(procs)


_UNREADABLE = "\0unreadable"


class TagReader:
    """Reads job tags from /proc/PID/environ, each process's at most once while it lives."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int], str | None] = {}
        self._logged_unreadable = -1

    def tags(self, table: ProcTable) -> dict[str, set[int]]:
        """job id -> live processes carrying its tag."""
        cache = self._cache  # (the scanner's thread and the loop at startup may both read tags)
        fresh: dict[tuple[int, int], str | None] = {}
        found: dict[str, set[int]] = {}
        for p in table.procs.values():
            if p.zombie or p.kernel_thread:
                continue
            key = (p.pid, p.start_ticks)
            tag = cache[key] if key in cache else _read_tag(p.pid)
            fresh[key] = tag
            if tag is not None and tag != _UNREADABLE:
                found.setdefault(tag, set()).add(p.pid)
        # Dropping the gone processes keeps the cache as small as the process table.
        self._cache = fresh
        unreadable = sum(1 for t in fresh.values() if t == _UNREADABLE)
        if unreadable != self._logged_unreadable:
            self._logged_unreadable = unreadable
            if unreadable:
                logger.info(
                    "%d processes' environments are unreadable (other users'): a job process among "
                    "them that left the job's session is not tracked",
                    unreadable,
                )
        return found


def _read_tag(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:
        return _UNREADABLE
    at = env.find(_TAG_BYTES)
    # The variable must start an entry, not sit inside another's value.
    while at > 0 and env[at - 1] != 0:
        at = env.find(_TAG_BYTES, at + 1)
    if at < 0:
        return None
    start = at + len(_TAG_BYTES)
    end = env.find(b"\0", start)
    return env[start : end if end >= 0 else len(env)].decode(errors="replace")


def members(
    table: ProcTable,
    tagged: dict[str, set[int]],
    *,
    job_id: str,
    leader_pid: int,
    leader_ticks: int,
    exclude: Iterable[int] = (),
    orphans: Iterable[int] = (),
    sessions: Iterable[tuple[int, int]] = (),
    keeper: tuple[int, int] | None = None,
) -> list[int]:
    """The job's live processes, sorted; `exclude` (the sidecar itself) never counts. `orphans`:
    processes reparented to the sidecar that were attributed to this job. `sessions`: (session
    id, leader start ticks or 0) of sessions the job's processes were seen in (see `sessions_of`):
    every process in one is the job's, unless its id now names a live stranger (another start
    time, or any live process where the leader was already gone: the id was reused). `keeper`:
    (pid, start ticks) of the job's keeper, whose every child is the job's while it lives (it is
    the subreaper of all the job leaves behind); the keeper itself never counts."""
    exclude = set(exclude)
    roots = set(tagged.get(job_id, ())) | set(orphans)
    if keeper is not None and table.live(*keeper):
        exclude.add(keeper[0])
        roots.update(table.children().get(keeper[0], ()))
    for sid, ticks in sessions:
        holder = table.procs.get(sid)
        if holder is None or (ticks and holder.start_ticks == ticks):
            roots.update(p.pid for p in table.procs.values() if p.session == sid)
    leader = table.procs.get(leader_pid)
    if leader is not None and leader_ticks and leader.start_ticks == leader_ticks:
        # The PID is still ours (alive or our unreaped zombie): so are its session and group.
        roots.add(leader_pid)
        roots.update(p.pid for p in table.procs.values() if leader_pid in (p.session, p.pgrp))
    elif leader is None:
        # Gone, but a PID that is someone's session or group id is never reused: those are ours.
        roots.update(p.pid for p in table.procs.values() if leader_pid in (p.session, p.pgrp))
    found = table.closure(roots, exclude)
    return sorted(pid for pid in found if not table.procs[pid].zombie)


def sessions_of(table: ProcTable, pids: Iterable[int]) -> set[tuple[int, int]]:
    """(session id, its leader's start ticks, 0 if the leader is gone) of the sessions the
    processes among `pids` are in. A job's processes are only ever in sessions the job started
    (its leader's, or one a process of it made with setsid())."""
    out = set()
    for pid in pids:
        p = table.procs.get(pid)
        if p is None or p.session <= 0:
            continue
        leader = table.procs.get(p.session)
        out.add((p.session, leader.start_ticks if leader is not None else 0))
    return out


def orphans_of_jobs(
    table: ProcTable, me: int, own: frozenset[int], leaders: dict[str, tuple[int, int]]
) -> dict[str, set[int]]:
    """Processes reparented to the sidecar `me` (not its own children), each given to the job
    (id -> (leader pid, leader start ticks)) started last before it; with no such job, to all."""
    ordered = sorted(leaders.items(), key=lambda kv: kv[1][1])
    out: dict[str, set[int]] = {}
    for p in table.procs.values():
        if p.ppid != me or p.zombie or p.pid in own:
            continue
        before = [job for job, (_pid, ticks) in ordered if ticks <= p.start_ticks]
        for job in before[-1:] or [job for job, _ in ordered]:
            out.setdefault(job, set()).add(p.pid)
    return out


def send_signal(p: Proc, sig: signal.Signals) -> None:
    """Signal the process `p` names, and nothing else: through a pidfd checked against its start time."""
    try:
        fd: int | None = os.pidfd_open(p.pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds here: a PID checked just before is the best we have
        fd = None
    try:
        now = read_proc(p.pid)
        if now is None or now.start_ticks != p.start_ticks:
            return  # the PID names another process now
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(p.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        logger.warning("not allowed to send %s to pid %d of a job", sig.name, p.pid)
    finally:
        if fd is not None:
            os.close(fd)


KCMP_FILES, KCMP_FS = 2, 3
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def shares(pid: int, tid: int, kind: int) -> bool:
    """Whether thread `tid` shares thread `pid`'s file table (KCMP_FILES) or cwd and root
    (KCMP_FS), by kcmp(2). False when the kernel will not say (no kcmp, a seccomp filter, another
    architecture, a thread that has exited and holds neither): then each is looked at on its own."""
    if _SYS_KCMP is None:
        return False
    return int(_libc().syscall(_SYS_KCMP, pid, tid, kind, 0, 0)) == 0
