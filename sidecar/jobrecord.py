"""What a job is: its durable record, where records are stored, and how its program is found.

`sidecar.jobs` supervises jobs; this module only describes them, so the ledger can store records
without importing the supervisor's machinery.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from sidecar import proctree
from sidecar.compat import SLOTS
from sidecar.errors import PreconditionError
from sidecar.paths import open_regular


@dataclass(frozen=True, **SLOTS)
class JobRecord:
    """One supervised job. Immutable: every state change stores a new record."""

    id: str
    cell: str
    argv: list[str]
    cwd: str
    # Only the extra variables the caller asked for, not the inherited environment or the tag.
    env: dict[str, str]
    pid: int
    pgid: int
    state: str  # "running" | "exited" | "stopped" | "lost"
    exit_code: int | None  # the leader's; negative: the signal that ended it; None: unknown
    started_at_ns: int
    ended_at_ns: int | None
    log_path: str
    # Field 22 of /proc/PID/stat at start: tells our process apart from a later one with its PID.
    proc_start_ticks: int
    # The leader has exited (exit_code is its status) while other processes of the job live on.
    leader_exited: bool = False
    # The job's live processes at the last scan; stored only as a snapshot, never trusted.
    live_pids: list[int] = field(default_factory=list)
    # [pid, start ticks] of the orphans the sidecar (their subreaper) gave this job: after a
    # sidecar restart they are init's children, and only this record still ties them to the job.
    adopted: list[list[int]] = field(default_factory=list)
    # [session id, its leader's start ticks or 0] of every session a process of this job was seen
    # in: a process in one is the job's even once it was reparented to init with its environment
    # cleared (an orphan's child, after a sidecar restart made init their reaper).
    sessions: list[list[int]] = field(default_factory=list)
    # [pid, start ticks] of the job's keeper (see sidecar.keeper), the parent of its leader and the
    # subreaper of everything the job leaves behind. Empty in records from before keepers.
    keeper: list[int] = field(default_factory=list)
    # The boot the job started in (/proc/sys/kernel/random/boot_id): no process outlives a reboot.
    boot_id: str = ""
    # Its keeper vanished before the job ended without being the sidecar's child (so its orphans
    # went to init, out of view): the job holds the gate until it is stopped by hand.
    keeper_lost: bool = False
    # Restart policy: "never", or "on-failure" (a nonzero exit or a signal) up to max_restarts
    # times, the n-th after backoff_s * 2**(n-1) seconds (at most MAX_BACKOFF_S).
    restart: str = "never"
    max_restarts: int = 0
    backoff_s: float = 0.0
    restarts: int = 0  # how many times it was started again so far
    # When it is due to be started again (time.time_ns()), while it waits out its backoff; 0 when
    # no restart is due. Kept across a sidecar restart, which arms it again.
    restart_at_ns: int = 0
    # The checkpoint this run was told to resume from (BOXWARDEN_RESUME_FROM; "" for none): retention
    # keeps its box copy while the run lasts.
    resume_from: str = ""

    @property
    def exit_path(self) -> Path:
        """Where the keeper writes the leader's exit status."""
        return Path(self.log_path).with_suffix(".exit")

    def recorded_exit(self) -> int | None:
        """The leader's exit status as its keeper recorded it; None before it exited (or if the
        keeper could not record it, or the job has no keeper)."""
        lines = exit_lines(self.exit_path) if self.keeper else []
        try:
            return int(lines[0]) if lines else None
        except ValueError:
            return None

    def keeper_ended(self) -> bool:
        """The keeper recorded that the job's last process ended (it was not killed before)."""
        return bool(self.keeper) and exit_lines(self.exit_path)[1:2] == ["end"]


def exit_lines(path: Path) -> list[str]:
    """What a keeper wrote in a job's exit file: its leader's status, then "end" once the job's last
    process ended; [] if there is no such file."""
    try:  # the job could put a FIFO there: never block on it
        fd = open_regular(path)
    except OSError:
        return []
    try:
        return os.read(fd, 4096).decode(errors="replace").split()
    except OSError:
        return []
    finally:
        os.close(fd)


class JobStore(Protocol):
    """Durable home of job records (the ledger implements it)."""

    def save_job(self, job: JobRecord) -> None: ...

    def load_jobs(self) -> list[JobRecord]: ...


NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_CHARS = "letters, digits, '.', '_' or '-' (at most 64, starting with a letter or digit)"


def check_name(name: str, what: str) -> str:
    """A roster cell or queue name: one safe path component (a cell names <watch>/<cell>/)."""
    if not NAME_RULE.fullmatch(name):
        raise PreconditionError(f"{what} {name!r} is not allowed: use {NAME_CHARS}")
    return name


def read_start_ticks(pid: int, *, include_zombie: bool = False) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone (or a zombie)."""
    p = proctree.read_proc(pid)
    if p is None or (p.zombie and not include_zombie):
        return None
    return p.start_ticks


def resolve_program(program: str, cwd: Path, path: str) -> str:
    """The executable argv[0] names, looked up the way exec would from `cwd`."""
    if "/" in program:
        candidate = cwd / program
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
        raise PreconditionError(f"{program!r} is not an executable file (relative to {str(cwd)!r})")
    found = shutil.which(program, path=path)
    if found is None:
        raise PreconditionError(f"{program!r} was not found on the job's PATH ({path})")
    return found
