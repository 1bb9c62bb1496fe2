"""Reaping a VRAM zombie on request: the one place the sidecar signals a process that is no job's.

Owns `reap`: end a process that holds GPU memory outside every supervised job (what VRAM_ZOMBIE
names), only when asked, and only when every check holds; any doubt refuses with nothing sent.

Before the first signal:
- a pidfd is opened on the pid, and the process's start time read; every signal goes through that
  pidfd, so a pid reused by another process later is never signalled (no pidfds: refused);
- a GPU reading begun after the pidfd was opened (the health hub's GPU probe thread, within its
  deadline; never the cached snapshot) lists the pid as holding GPU memory, outside every running
  job's process tree (the same rule as the alert, `gpu.vram_zombies`);
- the pid is no process of a running job (those are stopped with `boxwarden stop`), no job's keeper,
  not the sidecar, one of its ancestors or one of its descendants;
- with NVML readings: the sidecar shares the host's PID namespace (NVML's pids are the host's) and
  the process has an NVIDIA device open (/proc/PID/fd);
- the sidecar may signal it (signal 0), and it is still the process the pidfd was opened on.

Then SIGTERM, up to the grace for it to exit, SIGKILL and a few seconds more. It counts as gone
once its pidfd says it exited and /proc shows no live process with its pid and start time; a
zombie (exited, its parent has not waited for it yet) holds no GPU memory, and is said to be one.
Each reap that sent a signal is journaled as PROCESS_REAPED.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import select
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar import proctree
from sidecar.compat import SLOTS
from sidecar.errors import NotFoundError, PreconditionError
from sidecar.gpu import GpuProcess, GpuReading, GpuSample, vram_zombies
from sidecar.jobrecord import read_start_ticks

if TYPE_CHECKING:
    from sidecar.health import HealthHub
    from sidecar.jobs import JobSupervisor
    from sidecar.ledger import Ledger

logger = logging.getLogger(__name__)

GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL when the request gives none."""

MAX_GRACE_S = 3600.0

KILL_WAIT_S = 5.0
"""How long a process is given to exit after SIGKILL (one in uninterruptible I/O may take longer)."""

_MAX_DEPTH = 4096  # a parent chain longer than this is not followed (a race with exits, or a loop)

# Reaps past their first signal run to the end and are journaled even if the caller gives up.
_ending: set[asyncio.Task[Reaped]] = set()


@dataclass(frozen=True, **SLOTS)
class Reaped:
    gone: bool
    detail: str


async def reap(
    pid: int,
    grace_s: float,
    *,
    health: HealthHub,
    jobs: JobSupervisor,
    ledger: Ledger,
    notify: Callable[[], None],
) -> Reaped:
    """End `pid`, a VRAM zombie, if every check in the module's docstring holds (else NotFoundError
    or PreconditionError, with nothing sent): SIGTERM, SIGKILL after `grace_s`."""
    if not 0 < grace_s <= MAX_GRACE_S:
        raise PreconditionError(f"grace {grace_s:g} s: give 1 to {MAX_GRACE_S:g} seconds")
    if pid <= 0:
        raise NotFoundError(f"{pid} is not a process id: give the pid a VRAM_ZOMBIE names")
    if pid == 1:
        raise PreconditionError("pid 1 (the box's init) is never reaped")
    pidfd = _open_pidfd(pid)
    try:
        held, ticks, name = await _check(pid, pidfd, health, jobs)
        # At once, with no await since the last check: nothing else runs in between.
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        except ProcessLookupError:  # it exited just now: the wait sees it
            pass
        except PermissionError:
            raise PreconditionError(
                f"the sidecar may not signal pid {pid} ({name}): nothing was sent"
            ) from None
    except BaseException:
        os.close(pidfd)
        raise
    # From the first signal on, the reap runs to its end and is journaled even if the caller leaves.
    task = asyncio.ensure_future(_end(pid, pidfd, ticks, name, held, grace_s, ledger, notify))
    _ending.add(task)
    task.add_done_callback(_ending.discard)
    return await asyncio.shield(task)


# ---- the checks (nothing is sent before all of them passed) --------------------------------------


def _open_pidfd(pid: int) -> int:
    opener = getattr(os, "pidfd_open", None)
    if opener is None or getattr(signal, "pidfd_send_signal", None) is None:
        raise PreconditionError(
            "this sidecar's Python has no pidfds (Linux 5.3 and Python 3.9 needed): without one a "
            f"reused pid could be signalled; nothing was sent; end pid {pid} by hand on the box"
        )
    try:
        fd: int = opener(pid)
    except ProcessLookupError:
        raise NotFoundError(
            f"no process {pid} on this box: it has ended, or runs in another PID namespace"
        ) from None
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise NotFoundError(f"{pid} is not a process id on this box (a thread's?)") from None
        raise PreconditionError(
            f"no pidfd for pid {pid} ({e}): without one a reused pid could be signalled; nothing was "
            "sent; end it by hand on the box"
        ) from None
    return fd


async def _check(
    pid: int, pidfd: int, health: HealthHub, jobs: JobSupervisor
) -> tuple[list[tuple[GpuSample, GpuProcess]], int, str]:
    """What `pid` holds on which GPU, its start ticks and command name; raises unless it may be ended."""
    proc = proctree.read_proc(pid)
    # The pidfd's process still running after this read means the read was of that process.
    if proc is None or _exited(pidfd):
        raise NotFoundError(f"pid {pid} has already exited{_zombie_note(proc)}: nothing to reap")
    if proc.kernel_thread:
        raise PreconditionError(f"pid {pid} is a kernel thread: it is never reaped")
    name = _comm(pid)

    reading = await health.gpu_reading_now()  # begun after the pidfd was opened

    every = await jobs.jobs_now(strict=True)  # each running job's processes as they are now
    running = [j for j in every if j.state == "running"]
    for j in running:
        if pid == j.pid or pid in j.live_pids:
            raise PreconditionError(
                f"pid {pid} is a process of job {j.id}: jobs are never reaped; end it with "
                f"`boxwarden stop NAME {j.id}`"
            )
    for j in every:
        if j.keeper and j.keeper[0] == pid and j.keeper[1] in (0, proc.start_ticks):
            raise PreconditionError(
                f"pid {pid} is the keeper of job {j.id}; stop the job with `boxwarden stop`"
            )
    me = os.getpid()
    if pid in _lineage(me):
        raise PreconditionError(f"pid {pid} is the sidecar (pid {me}) or one of its ancestors: never reaped")
    if me in _lineage(pid):
        raise PreconditionError(
            f"pid {pid} descends from the sidecar (a job's keeper, or a process of a job): never reaped; "
            "stop its job with `boxwarden stop`"
        )

    job_pids = {p for j in running for p in (j.pid, *j.live_pids)} | {me}
    held = [(g, p) for g, p in vram_zombies(reading, job_pids) if p.pid == pid]
    if not held:
        raise NotFoundError(
            f"pid {pid} ({name}) holds no GPU memory in a GPU reading taken now ({_listed(reading)}): "
            "only a process a VRAM_ZOMBIE alert names can be reaped (`boxwarden status NAME`)"
        )
    if reading.source == "nvml":
        _check_nvml_pid(pid)

    try:
        signal.pidfd_send_signal(pidfd, 0)  # may we signal it at all (another user's process)?
    except ProcessLookupError:
        raise NotFoundError(f"pid {pid} exited while it was being checked: nothing to reap") from None
    except PermissionError:
        raise PreconditionError(
            f"the sidecar may not signal pid {pid} ({name}; another user's process): end it as that user"
        ) from None
    if read_start_ticks(pid) != proc.start_ticks or _exited(pidfd):
        raise NotFoundError(f"pid {pid} exited while it was being checked: nothing to reap")
    return held, proc.start_ticks, name


def _check_nvml_pid(pid: int) -> None:
    """NVML's pids are the host's: they name the same process here only in the host's PID
    namespace, and a process that holds GPU memory has an NVIDIA device open."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
    except OSError:
        nspid = []
    if len(nspid) != 1:
        raise PreconditionError(
            "the sidecar runs in a PID namespace of its own (a container): NVML's pids are the host's, "
            f"and pid {pid} here may be another process; end it from the host"
        )
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        raise NotFoundError(f"pid {pid} exited while it was being checked: nothing to reap") from None
    except OSError as e:
        raise PreconditionError(f"cannot see pid {pid}'s open files ({e}): not reaped") from None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                return
        except OSError:  # closed since the listing
            continue
    raise PreconditionError(
        f"pid {pid} has no NVIDIA device open here, though NVML lists it: it is not the process NVML "
        "means; not reaped"
    )


def _lineage(pid: int) -> list[int]:
    """`pid` and its ancestors, nearest first."""
    out: list[int] = []
    while pid > 0 and pid not in out and len(out) < _MAX_DEPTH:
        out.append(pid)
        p = proctree.read_proc(pid)
        if p is None:
            break
        pid = p.ppid
    return out


def _listed(reading: GpuReading) -> str:
    pids = sorted({p.pid for g in reading.gpus for p in g.processes})
    where = f"{reading.source}: " if reading.source else ""
    listed = f"{where}pids {', '.join(map(str, pids))} hold GPU memory" if pids else f"{where}no process"
    if not reading.gpus:
        listed = f"{where}no GPU"
    return f"{listed}; {reading.error}" if reading.error else listed


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read(64).decode(errors="replace").strip() or "?"
    except OSError:
        return "?"


# ---- the signals ---------------------------------------------------------------------------------


async def _end(
    pid: int,
    pidfd: int,
    ticks: int,
    name: str,
    held: list[tuple[GpuSample, GpuProcess]],
    grace_s: float,
    ledger: Ledger,
    notify: Callable[[], None],
) -> Reaped:
    """SIGTERM was sent: wait out the grace, SIGKILL, say what became of it and journal it."""
    sent = ["SIGTERM"]
    try:
        exited = await _wait_exit(pidfd, grace_s)
        if not exited:
            logger.info("pid %s outlived its %.1fs grace; sending SIGKILL", pid, grace_s)
            sent.append(f"{_send(pidfd, signal.SIGKILL)} after {grace_s:g} s")
            exited = await _wait_exit(pidfd, KILL_WAIT_S)
    finally:
        os.close(pidfd)
    gone, fate = _fate(pid, ticks, exited)
    what = "; ".join(
        f"{p.used_memory_bytes if p.used_memory_bytes is not None else 'some'} bytes of GPU {g.index}"
        + (f" ({g.uuid})" if g.uuid else "")
        for g, p in held
    )
    detail = f"pid {pid} ({name}) held {what}; sent {', then '.join(sent)}; {fate}"
    logger.warning("reaped on request: %s", detail)
    ledger.add_event("PROCESS_REAPED", detail=detail)
    notify()
    return Reaped(gone, detail)


def _send(pidfd: int, sig: signal.Signals) -> str:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:  # it exited just before: the wait sees it
        pass
    except PermissionError:  # it changed its user since it was checked (a setuid exec)
        return f"{sig.name} (not permitted)"
    return sig.name


def _exited(pidfd: int) -> bool:
    """The pidfd's process has exited (a pidfd turns readable then, and stays readable)."""
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


async def _wait_exit(pidfd: int, timeout: float) -> bool:
    """Whether the process exits within `timeout`: its pidfd awaited on the loop, never blocking it."""
    if _exited(pidfd):
        return True
    loop = asyncio.get_running_loop()
    readable = loop.create_future()

    def wake() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(pidfd, wake)
    try:
        await asyncio.wait({readable}, timeout=timeout)
    finally:
        loop.remove_reader(pidfd)
    return _exited(pidfd)


def _fate(pid: int, ticks: int, exited: bool) -> tuple[bool, str]:
    """(gone, what became of it), from its pidfd and what /proc shows now."""
    now = proctree.read_proc(pid)
    same = now is not None and now.start_ticks == ticks
    if not exited or (same and now is not None and not now.zombie):
        state = f" (state {now.state})" if same and now is not None else ""
        return False, (
            f"it still runs{state} after SIGKILL: a process in uninterruptible I/O (state D) ends when "
            "its I/O does; reap it again later"
        )
    if same and now is not None:
        return True, (
            f"it exited, and is a zombie (state {now.state}) until its parent (pid {now.ppid}) waits "
            "for it: a zombie holds no GPU memory"
        )
    return True, "it exited and is gone from /proc"


def _zombie_note(proc: proctree.Proc | None) -> str:
    if proc is None or not proc.zombie:
        return ""
    return f" (a zombie until its parent, pid {proc.ppid}, waits for it; it holds no GPU memory)"
