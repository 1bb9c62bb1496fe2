"""The sidecar's worker threads yield to the trainer.

This module owns the priority of the threads that hash, scan and push: `lower_this_thread`, given
to an executor as its `initializer`, puts the calling thread at CPU nice +10 and at the lowest
level (7) of the best-effort I/O class, so that on a box whose cores and disk are busy the
trainer's steps and its own reads and writes come first, while a push still moves (the idle I/O
class could starve it until the box is gone, and a drain must end within a grace window). The
asyncio loop and the gRPC threads keep their priority, so that answers stay prompt.

On Linux both are per thread (a thread id goes where a process id is expected), and what a
lowered thread starts (a thread, the child that re-reads a copy) inherits both. Best effort: where
the kernel refuses, or no ioprio syscall is known for this machine, the thread keeps its priority
and one debug line says so. Nothing here ever raises a priority: a sidecar started at nice 15 or in
the idle I/O class stays there.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import threading
from collections.abc import Callable
from typing import cast

logger = logging.getLogger(__name__)

NICE = 10
"""The workers' nice value (0 is the default; 19 the lowest priority)."""

IOPRIO_CLASS_BE = 2
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
IOPRIO_LEVEL = 7
"""Best-effort levels run 0 (first) to 7 (last); the default follows nice ((nice + 20) // 5)."""

LOWERED_IOPRIO = (IOPRIO_CLASS_BE << IOPRIO_CLASS_SHIFT) | IOPRIO_LEVEL
"""The I/O priority value a lowered thread has (as ioprio_get returns it)."""

_WHO_PROCESS = 1  # IOPRIO_WHO_PROCESS: `who` is a process id, or on Linux any thread id
# (ioprio_set, ioprio_get) for 64-bit userlands only: a 32-bit one on the same kernel has others.
_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "riscv64": (30, 31)}

_refusal_noted = threading.Event()


def lower_this_thread() -> None:
    """Put the calling thread at nice NICE and I/O priority best-effort 7, unless it is lower
    already. Never raises (an executor whose initializer raises is broken for good)."""
    try:
        refused = _lower(threading.get_native_id())
    except Exception as exc:  # a priority is never worth a broken executor
        refused = [f"{type(exc).__name__}: {exc}"]
    if refused and not _refusal_noted.is_set():
        _refusal_noted.set()
        logger.debug("worker threads keep their priority: %s", "; ".join(refused))


def _lower(tid: int) -> list[str]:
    """Lower thread `tid`; returns what was refused, as words."""
    refused: list[str] = []
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < NICE:
            os.setpriority(os.PRIO_PROCESS, tid, NICE)
    except OSError as exc:
        refused.append(f"nice {NICE}: {exc.strerror or exc}")
    try:
        now = _ioprio(1, _WHO_PROCESS, tid)
        if now is None:
            refused.append(f"I/O priority: no ioprio syscall known for {platform.machine()}")
        elif now >> IOPRIO_CLASS_SHIFT != IOPRIO_CLASS_IDLE and now != LOWERED_IOPRIO:
            _ioprio(0, _WHO_PROCESS, tid, LOWERED_IOPRIO)
    except OSError as exc:
        refused.append(f"I/O priority: {exc.strerror or exc}")
    return refused


def thread_priority(tid: int | None = None) -> tuple[int, int | None]:
    """(nice, I/O priority value) of a thread of this process, the calling one by default, as
    the kernel reports them; the I/O priority is None where it cannot be read."""
    tid = threading.get_native_id() if tid is None else tid
    with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as f:
        stat = f.read()
    # Field 19 is nice; count after the command name, which may hold spaces and parentheses.
    nice = int(stat.rsplit(")", 1)[1].split()[19 - 3])
    try:
        io = _ioprio(1, _WHO_PROCESS, tid)
    except OSError:
        io = None
    return nice, io


def _ioprio(op: int, *args: int) -> int | None:
    """ioprio_set (op 0) or ioprio_get (op 1); None where this machine's syscall is unknown."""
    numbers = _SYSCALLS.get(platform.machine())
    syscall = _syscall()
    if numbers is None or syscall is None or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    result = syscall(ctypes.c_long(numbers[op]), *(ctypes.c_long(a) for a in args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


@functools.cache
def _syscall() -> Callable[..., int] | None:
    """libc's syscall(2), or None (not Linux, an odd libc)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return cast("Callable[..., int]", fn)
