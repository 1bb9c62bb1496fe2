"""What Python 3.9 needs done otherwise: the sidecar runs on the box's own Python, 3.9 and newer.

The controller needs 3.11; `make py39-check` holds the sidecar to 3.9. Each name here makes the
sidecar on 3.9 behave as it does on the newer Pythons.
"""

from __future__ import annotations

import os
import sys

# Keyword arguments for @dataclass: slots on 3.10 and newer (smaller, faster instances); on 3.9
# the instances keep a __dict__, which nothing in the sidecar relies on either way.
SLOTS: dict[str, bool] = {"slots": True} if sys.version_info >= (3, 10) else {}


def grpc_fork_handlers_off() -> dict[str, str]:
    """Call before grpc loads. On Python 3.9, switch gRPC's fork handlers off in this process;
    return the environment the sidecar was started with, which is what its jobs get.

    subprocess forks with fork() on 3.9 (vfork() from 3.10 on, which runs no fork handler), and
    gRPC's handlers, run in the child between fork and exec, crashed it now and then: a keeper
    died of SIGSEGV before starting its job, 3 job starts in 25. The sidecar forks only to exec,
    which needs no handler."""
    inherited = dict(os.environ)
    if sys.version_info < (3, 10):
        os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "0"
    return inherited
