"""A job's keeper: the small process between the sidecar and a job that holds the job's whole tree.

The sidecar starts one keeper per job (`python -I keeper.py ...`, the standard library only, so
that nothing in the job's environment changes how it runs). The keeper makes itself a child
subreaper, starts the job's leader in a session of its own, and then only waits: every process
the job leaves behind, however it forks, setsid()s or clears its environment, is reparented to
the keeper rather than to init, so the job's processes are exactly the keeper's descendants for
as long as the keeper lives. The keeper outlives the sidecar (it has its own session and never
talks to it after the start), so this holds across a sidecar restart too.

It writes the leader's exit status (a Popen-style return code: negative for a signal) to EXIT_FILE
the moment it reaps the leader, and exits once it has no child left, i.e. when the job's last
process has ended. The sidecar never signals the keeper; it signals the job's processes.

    python -I keeper.py NOTIFY_FD EXIT_FILE CWD EXECUTABLE ARGV0 [ARG...]

On NOTIFY_FD it writes one line, then closes it: `ok LEADER_PID LEADER_START_TICKS SUBREAPER`
(SUBREAPER is 1, or 0 where the kernel refused) or `error MESSAGE` when the leader could not be
started (its exit code is then 1). Must run on Python 3.9.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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


def write_exit(path: str, rc: int) -> None:
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"%d\n" % rc)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as e:
        # The sidecar then reports the job "lost" rather than inventing a status.
        print(f"boxwarden keeper: cannot record the job's exit status in {path}: {e}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if len(argv) < 6:
        print("usage: keeper.py NOTIFY_FD EXIT_FILE CWD EXECUTABLE ARGV0 [ARG...]", file=sys.stderr)
        return 2
    notify, exit_file, cwd, executable, args = int(argv[1]), argv[2], argv[3], argv[4], argv[5:]
    # A Ctrl-C meant for someone else must not print a traceback into the job's log.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
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
            return 0
        if pid == leader.pid:
            leader.returncode = os.waitstatus_to_exitcode(status)  # so Popen never waits for it
            write_exit(exit_file, leader.returncode)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
