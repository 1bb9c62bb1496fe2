"""Starting a job's processes: its keeper (`sidecar.keeper`), a child of the sidecar that starts the
job's leader in a session of its own, reports the leader (or why it could not start it) on a pipe,
then reaps everything the job leaves behind and records the leader's exit status. What to start
goes to the keeper in a file, never on its command line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sidecar import children, proctree
from sidecar.errors import PreconditionError

logger = logging.getLogger(__name__)

KEEPER = Path(__file__).with_name("keeper.py")
KEEPER_REPORT_S = 60.0
"""A keeper reports its leader (or why it could not start it) within this time, or the start fails."""
REPORT_POLL_S = 0.2


async def start_keeper(
    job_id: str,
    argv: list[str],
    executable: str,
    workdir: Path,
    env: dict[str, str],
    log_path: Path,
    tags: proctree.TagReader,
) -> tuple[subprocess.Popen[Any], int, int]:
    """Start the job's keeper and have it start the leader: (keeper, leader pid, its start ticks).
    PreconditionError, saying why, when it cannot (the keeper reported an error, or nothing)."""
    exit_path = log_path.with_suffix(".exit")
    # What to start goes in a file, not in the keeper's command line: `pkill -f train.py` must
    # not match the keeper.
    spec = log_path.with_suffix(".spec")
    spec_doc = {"exit_file": str(exit_path), "cwd": str(workdir), "executable": executable, "argv": argv}
    try:
        log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        exit_path.unlink(missing_ok=True)  # never read some earlier job's status as this one's
        fd = os.open(spec, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(spec_doc, f)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError as e:  # a full disk, no file descriptors left
        spec.unlink(missing_ok=True)
        raise PreconditionError(f"cannot start {argv[0]!r}: {e} (the job log dir {log_path.parent})") from e
    try:
        notify, notify_w = os.pipe()
    except OSError as e:
        os.close(log_fd)
        spec.unlink(missing_ok=True)
        raise PreconditionError(f"cannot start {argv[0]!r}: {e}") from e
    try:
        # Off the loop: a fork of a large process, and its exec, take milliseconds.
        keeper = await asyncio.to_thread(
            children.popen,
            [sys.executable, "-I", str(KEEPER), str(notify_w), str(spec)],
            cwd="/",
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(notify_w,),
        )
    except (OSError, ValueError) as e:  # ValueError: NUL byte or "=" in the environment
        os.close(notify)
        spec.unlink(missing_ok=True)
        raise PreconditionError(f"cannot start {argv[0]!r}: {e}") from e
    finally:
        os.close(notify_w)
        os.close(log_fd)
    try:
        report = await asyncio.to_thread(read_report, notify, KEEPER_REPORT_S, keeper.pid)
    except TimeoutError:
        report = f"error its keeper (pid {keeper.pid}) did not report within {KEEPER_REPORT_S:.0f}s"
        keeper.kill()  # our unreaped child: the PID is still its
        table = proctree.scan()
        for pid in tags.tags(table).get(job_id, ()):  # a leader it may have started
            proctree.send_signal(table.procs[pid], signal.SIGKILL)
    word, _, rest = report.partition(" ")
    if word == "ok":
        leader, ticks, reaper = (int(x) for x in rest.split())
        if not reaper:
            logger.warning(
                "job %s's keeper could not become a child subreaper: processes the job leaves "
                "behind are followed by their session and environment tag only",
                job_id,
            )
        return keeper, leader, ticks
    rc = await asyncio.to_thread(keeper.wait)
    children.release(keeper.pid)
    spec.unlink(missing_ok=True)
    why = rest if word == "error" else f"its keeper exited ({rc}) without starting it; see {log_path}"
    raise PreconditionError(f"cannot start {argv[0]!r}: {why}")


def read_report(fd: int, timeout: float, keeper: int) -> str:
    """Everything the keeper writes on its notify pipe until it closes it (one line); the pipe
    is closed here. TimeoutError if it says nothing for `timeout` seconds."""
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not select.select([fd], [], [], min(left, REPORT_POLL_S))[0]:
                wake_if_stopped(proctree.read_proc(keeper))  # our unreaped child: the PID is its
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                return data.decode(errors="replace").strip()
            data += chunk
    finally:
        os.close(fd)


def wake_if_stopped(keeper: proctree.Proc | None) -> None:
    """SIGCONT to a keeper that is stopped: the job it started may have stopped it, and a stopped
    keeper reaps nothing."""
    if keeper is not None and keeper.state in ("T", "t"):
        proctree.send_signal(keeper, signal.SIGCONT)
