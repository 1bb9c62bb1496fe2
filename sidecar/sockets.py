"""The sidecar's socket is its own: a lock beside it (`<socket>.lock`, held for the process's life)
keeps two sidecars off one socket path, and a socket that answers is never unlinked, whoever holds
it (a sidecar of an older version holds no lock). Two boxes that were given one socket path by
mistake then fail to start the second one, loudly, instead of the second taking over the first's
clients.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
from pathlib import Path
from typing import IO

from sidecar.errors import ConfigError


def answers(path: Path) -> bool:
    """Does something accept connections on the Unix socket `path`?"""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def claim(path: Path, state_dir: Path) -> IO[str]:
    """Take the socket path for this sidecar: its lock, then the path itself once nothing answers
    there (a dead sidecar's socket file is removed). Raises ConfigError naming what holds it."""
    lock_path = path.with_name(path.name + ".lock")
    f = open(lock_path, "a+")  # noqa: SIM115 - held for the process lifetime
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ConfigError(
            f"another sidecar holds the socket {path} (its lock {lock_path} is taken); this one, for the "
            f"state dir {state_dir}, does not start: give each box its own socket"
        ) from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return f
    if answers(path):
        f.close()
        raise ConfigError(
            f"a process answers on the socket {path} (a sidecar of another box or version?); this one, "
            f"for the state dir {state_dir}, does not start and leaves that socket alone"
        )
    if stat.S_ISSOCK(mode):
        path.unlink()  # a dead sidecar's: nothing answers there
    else:
        f.close()
        raise ConfigError(f"{path} is in the way of the sidecar's socket and is not a socket; move it")
    return f


def release(path: Path, lock: IO[str]) -> None:
    """At exit: remove the socket file (ours: the lock is held), then let the path go."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()
    except FileNotFoundError:
        pass
    lock.close()
