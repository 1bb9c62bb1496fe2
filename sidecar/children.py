"""The sidecar's own direct children, the child-subreaper setting, and reaping orphans.

Owns the registry of "children someone in this process waits for" (the jobs' keepers): every
child the sidecar forks is started through `popen()`, registered under the same lock the reaper
holds, and released once its waiter has collected its status.

As a child subreaper (`become_subreaper()`), the sidecar inherits every orphaned descendant of
its jobs instead of init, so a double-forked writer stays in our view; but an inherited process
that exits is a zombie until we wait for it. `reap_orphans()` waits only for zombies whose
parent is us and that nobody registered: reaping a registered child would steal the exit status
its `subprocess.Popen` waits for (Popen then reports 0 for a process it never saw end).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import subprocess
import threading
from typing import Any

from sidecar import proctree

logger = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36

# Held while a child is forked and registered, and while the reaper picks its zombies: the
# reaper can never see a registered child's zombie before its registration.
_lock = threading.Lock()
_own: set[int] = set()


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """Start a child that the caller will wait for; call `release(pid)` once it has been waited."""
    with _lock:
        proc: subprocess.Popen[Any] = subprocess.Popen(args, **kwargs)
        _own.add(proc.pid)
    return proc


def release(pid: int) -> None:
    """The caller has collected this child's status (or will never need it): it may be reaped."""
    with _lock:
        _own.discard(pid)


def registered() -> frozenset[int]:
    with _lock:
        return frozenset(_own)


def become_subreaper() -> bool:
    """Make orphaned descendants reparent to this process rather than init. False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    except (OSError, AttributeError) as e:
        logger.warning(
            "cannot become a child subreaper (%s): a job's double-forked processes are tracked only "
            "by their environment tag",
            e,
        )
        return False
    return True


def reap_orphans() -> int:
    """Wait for every zombie child of ours that no one registered; returns how many were reaped."""
    me = os.getpid()
    reaped = 0
    with _lock:
        for p in proctree.scan().procs.values():
            if p.ppid != me or not p.zombie or p.pid in _own:
                continue
            with contextlib.suppress(ChildProcessError):
                pid, _ = os.waitpid(p.pid, os.WNOHANG)
                reaped += pid == p.pid
    if reaped:
        logger.debug("reaped %d orphaned processes", reaped)
    return reaped


def install_reaper(loop: asyncio.AbstractEventLoop) -> None:
    """Reap orphans on SIGCHLD, on the loop (signals coalesce: one pass reaps every zombie)."""
    pending = False

    def run() -> None:
        nonlocal pending
        pending = False
        try:
            reap_orphans()
        except Exception:
            logger.exception("reaping orphaned processes failed")

    def on_sigchld() -> None:
        nonlocal pending
        if not pending:
            pending = True
            loop.call_soon(run)

    try:
        loop.add_signal_handler(signal.SIGCHLD, on_sigchld)
    except (RuntimeError, ValueError) as e:  # not the main thread: the job poll still reaps
        logger.warning("no SIGCHLD handler (%s); orphans are reaped by the job poll only", e)
    run()  # orphans inherited before the handler existed
