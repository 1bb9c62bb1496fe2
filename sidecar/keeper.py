"""A job's keeper: the small process between the sidecar and a job that holds the job's whole tree.

The sidecar starts one keeper per job (`python -I keeper.py ...`, the standard library only, so
that nothing in the job's environment changes how it runs). The keeper makes itself a child
subreaper, starts the job's leader in a session of its own, and then only waits: every process
the job leaves behind, however it forks, setsid()s or clears its environment, is reparented to
the keeper rather than to init, so the job's processes are exactly the keeper's descendants for
as long as the keeper lives. The keeper outlives the sidecar (it has its own session and never
talks to it after the start), so this holds across a sidecar restart too.

It writes the leader's exit status (a Popen-style return code: negative for a signal) to the exit
file the moment it reaps the leader, and once it has no child left, i.e. when the job's last
process has ended, writes it again with a second line, `end`, and exits. An exit file without
`end` after the keeper is gone means it was killed before its job ended. The sidecar never
signals the keeper (SIGCONT aside); it signals the job's processes. The keeper shrugs off SIGTERM,
SIGINT, SIGHUP and SIGQUIT (meant for the job; the leader gets its signals' defaults back at
exec), and its command line does not hold the job's, so `pkill -f train.py` leaves it alone.

    python -I keeper.py NOTIFY_FD SPEC_FILE

SPEC_FILE is JSON, {"exit_file", "cwd", "executable", "argv"}; the keeper deletes it once read.
On NOTIFY_FD it writes one line, then closes it: `ok LEADER_PID LEADER_START_TICKS SUBREAPER`
(SUBREAPER is 1, or 0 where the kernel refused) or `error MESSAGE` when the leader could not be
started (its exit code is then 1). Must run on Python 3.9.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat (the leader is at worst our unreaped zombie: it is there)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def tell(fd: int, line: str) -> None:
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode(errors="replace"))
    except OSError:  # the sidecar is gone already: the job runs all the same
        pass
    finally:
        os.close(fd)


def write_exit(path: str, rc: int, *, end: bool = False) -> None:
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"%d\n%s" % (rc, b"end\n" if end else b""))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as e:
        # The sidecar then reports the job "lost" rather than inventing a status.
        print(f"boxwarden keeper: cannot record the job's exit status in {path}: {e}", file=sys.stderr)


def shrug(signum: int, frame: object) -> None:
    """Signals meant for the job (a Ctrl-C, a pkill by name) do not end its keeper. A handler, not
    SIG_IGN: an ignored signal would stay ignored in the leader across exec."""


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: keeper.py NOTIFY_FD SPEC_FILE", file=sys.stderr)
        return 2
    notify = int(argv[1])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, shrug)
    try:
        with open(argv[2], "rb") as f:
            spec = json.load(f)
        os.unlink(argv[2])
        exit_file, cwd, executable, args = spec["exit_file"], spec["cwd"], spec["executable"], spec["argv"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        tell(notify, f"error its keeper could not read what to start: {e}")
        return 1
    reaper = become_subreaper()
    try:
        leader = subprocess.Popen(args, executable=executable, cwd=cwd, start_new_session=True)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        tell(notify, f"error {e}")
        return 1
    tell(notify, f"ok {leader.pid} {start_ticks(leader.pid)} {int(reaper)}")
    os.chdir("/")  # never hold the job's working directory
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # no child left: the job's last process has ended
            rc = leader.returncode if leader.returncode is not None else -signal.SIGKILL
            write_exit(exit_file, rc, end=True)
            return 0
        if pid == leader.pid:
            leader.returncode = os.waitstatus_to_exitcode(status)  # so Popen never waits for it
            write_exit(exit_file, leader.returncode)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
