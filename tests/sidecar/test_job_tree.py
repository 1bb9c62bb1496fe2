"""A job is its whole process tree: a real sidecar, real jobs that background or double-fork a
writer, across a SIGKILL restart; StopJob reaches escapees; orphans are reaped, not left zombies.

Every process a job leaves behind writes its PID (and start time) to a file; the `procs` fixture
kills whatever of them still lives at the end, so a failing test leaks nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.jobs import JobRecord, JobSupervisor
from tests.conftest import children_of, pid_alive, wait_until
from tests.sidecar.daemon import Daemon, make_daemon, running
from tests.sidecar.test_jobs import until_scanned

DEADLINE_S = 30.0

# A writer that appends to a "checkpoint" until a stop file appears (at most 120 s, so even a
# crashed test leaves nothing behind for long). It records its PID and start time first.
WRITER = textwrap.dedent("""
    import os, signal, sys, time
    pid_file, out, stop, mode = sys.argv[1:5]

    def record():
        ticks = open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]
        with open(pid_file + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {ticks}")
        os.rename(pid_file + ".tmp", pid_file)

    def write_until_stopped():
        if mode.startswith("stubborn"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        record()
        deadline = time.monotonic() + 120
        with open(out, "ab") as f:
            while not os.path.exists(stop) and time.monotonic() < deadline:
                f.write(b"step\\n")
                f.flush()
                time.sleep(0.02)

    if mode == "plain":
        write_until_stopped()
        sys.exit(0)
    # Double fork with setsid: the grandchild leaves the job's session and its parent.
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            if mode == "escape-untagged":  # no tag, not in the job's dir: `cd / && env -i setsid ...`
                os.chdir("/")
                os.execve(sys.executable, [sys.executable, sys.argv[0], pid_file, out, stop, "plain"], {})
            write_until_stopped()
        os._exit(0)
    os.wait()
    while not os.path.exists(pid_file):  # exit only once the escapee has recorded itself
        time.sleep(0.01)
    sys.exit(0)
""")


@dataclass
class Procs:
    """The processes the tests' jobs leave behind, by PID and start time."""

    root: Path
    seen: list[tuple[int, int]] = field(default_factory=list)

    def writer(self, name: str, mode: str) -> tuple[list[str], Path, Path, Path]:
        """argv for a writer job, and its pid file, output file and stop file."""
        script = self.root / "writer.py"
        script.write_text(WRITER)
        pid_file, out, stop = (self.root / f"{name}.{x}" for x in ("pid", "out", "stop"))
        return [sys.executable, str(script), str(pid_file), str(out), str(stop), mode], pid_file, out, stop

    def wait_pid(self, pid_file: Path) -> int:
        wait_until(pid_file.exists, timeout=DEADLINE_S, what=f"{pid_file.name}")
        pid, ticks = (int(x) for x in pid_file.read_text().split())
        self.seen.append((pid, ticks))
        return pid

    def kill_all(self) -> None:
        for pid, ticks in self.seen:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                if _stat(pid)[19] == str(ticks):  # the PID still names the process we recorded
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except (ProcessLookupError, FileNotFoundError):
                pass
            finally:
                os.close(fd)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.kill_all()


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (index 0 is the state)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def start(d: Daemon, argv: list[str]) -> pb.Job:
    return d.stub.StartJob(pb.StartJobRequest(argv=argv), timeout=10).job


def listed(d: Daemon, job_id: str) -> pb.Job:
    (job,) = [j for j in d.stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs if j.id == job_id]
    return job


def wait_job(d: Daemon, job_id: str, what: str, ok: object) -> pb.Job:
    def check() -> pb.Job | None:
        job = listed(d, job_id)
        return job if ok(job) else None  # type: ignore[operator]

    result: pb.Job = wait_until(check, timeout=DEADLINE_S, what=what)
    return result


def running_without_leader(pid: int) -> object:
    return lambda j: j.state == pb.JOB_STATE_RUNNING and j.leader_exited and pid in j.live_pids


def test_a_backgrounded_writer_keeps_the_job_running(tmp_path: Path, procs: Procs) -> None:
    argv, pid_file, out, stop = procs.writer("bg", "plain")
    with running(tmp_path) as d:
        job = start(d, ["sh", "-c", '"$@" & exit 0', "sh", *argv])
        writer = procs.wait_pid(pid_file)
        seen = wait_job(d, job.id, "the job running on its writer alone", running_without_leader(writer))
        assert job.pid not in seen.live_pids
        # It really is still writing the "checkpoint" the gate must not delete.
        size = out.stat().st_size
        wait_until(lambda: out.stat().st_size > size, timeout=DEADLINE_S, what="the writer to append")
        assert listed(d, job.id).state == pb.JOB_STATE_RUNNING
        stop.touch()
        done = wait_job(d, job.id, "the job to end", lambda j: j.state != pb.JOB_STATE_RUNNING)
        assert (done.state, done.exit_code, list(done.live_pids)) == (pb.JOB_STATE_EXITED, 0, [])
        assert not pid_alive(writer)


def test_a_double_forked_setsid_escapee_keeps_the_job_running(tmp_path: Path, procs: Procs) -> None:
    argv, pid_file, _, stop = procs.writer("esc", "escape")
    with running(tmp_path) as d:
        job = start(d, argv)
        escapee = procs.wait_pid(pid_file)
        assert int(_stat(escapee)[3]) != job.pgid  # its own session: outside the job's group
        seen = wait_job(d, job.id, "the job running on its escapee", running_without_leader(escapee))
        assert list(seen.live_pids) == [escapee]
        stop.touch()
        done = wait_job(d, job.id, "the job to end", lambda j: j.state != pb.JOB_STATE_RUNNING)
        assert (done.state, done.exit_code) == (pb.JOB_STATE_EXITED, 0)


def test_an_escapee_is_found_again_after_a_sidecar_sigkill(
    tmp_path: Path, sock_dir: Path, procs: Procs
) -> None:
    argv, pid_file, _, stop = procs.writer("restart", "escape")
    d = make_daemon(tmp_path, sock_dir)
    d.start()
    try:
        job = start(d, argv)
        escapee = procs.wait_pid(pid_file)
        wait_job(d, job.id, "the leader's exit to be seen", running_without_leader(escapee))
        d.kill(signal.SIGKILL)
        assert pid_alive(escapee)  # no longer anyone's child but init's: only its tag ties it to us
        d.start()
        again = listed(d, job.id)
        assert again.state == pb.JOB_STATE_RUNNING and again.leader_exited
        assert list(again.live_pids) == [escapee]
        stop.touch()
        done = wait_job(d, job.id, "the job to end", lambda j: j.state != pb.JOB_STATE_RUNNING)
        # The first sidecar recorded the leader's status before it was killed.
        assert (done.state, done.exit_code) == (pb.JOB_STATE_EXITED, 0)
    finally:
        d.kill(signal.SIGTERM)


def test_an_untagged_escapee_is_found_again_after_a_sidecar_sigkill(
    tmp_path: Path, sock_dir: Path, procs: Procs
) -> None:
    """Review 2, finding 2: an orphan that cleared its environment belonged to the job only while
    the sidecar was its parent; after a SIGKILL and restart it was init's child, and the job was
    "exited" while the orphan still wrote. The job record now keeps the orphans it was given."""
    argv, pid_file, _, stop = procs.writer("untagged", "escape-untagged")
    d = make_daemon(tmp_path, sock_dir)
    d.start()
    try:
        job = start(d, argv)
        escapee = procs.wait_pid(pid_file)
        assert Path(f"/proc/{escapee}/cwd").resolve() == Path("/")
        wait_job(d, job.id, "the orphan to be given to the job", running_without_leader(escapee))
        d.kill(signal.SIGKILL)
        assert pid_alive(escapee)  # init's child now, with no tag and no session of the job's
        d.start()
        again = listed(d, job.id)
        assert again.state == pb.JOB_STATE_RUNNING and list(again.live_pids) == [escapee]
        stop.touch()
        done = wait_job(d, job.id, "the job to end", lambda j: j.state != pb.JOB_STATE_RUNNING)
        assert done.state == pb.JOB_STATE_EXITED
    finally:
        d.kill(signal.SIGTERM)


def test_stop_job_kills_the_escapee_too(tmp_path: Path, procs: Procs) -> None:
    argv, pid_file, _, _ = procs.writer("stop", "stubborn-escape")
    with running(tmp_path) as d:
        job = start(d, argv)
        escapee = procs.wait_pid(pid_file)
        stopped = d.stub.StopJob(pb.StopJobRequest(id=job.id, grace_s=1), timeout=30).job
        assert stopped.state == pb.JOB_STATE_STOPPED
        # It ignored SIGTERM: the SIGKILL after the grace ended it.
        wait_until(lambda: not pid_alive(escapee), timeout=DEADLINE_S, what="the escapee to die")
        assert listed(d, job.id).state == pb.JOB_STATE_STOPPED


def escaped_job(d: Daemon, procs: Procs, name: str) -> tuple[pb.Job, int, Path]:
    """A job whose leader exited, leaving a double-forked writer: (the job, the writer, its stop file)."""
    argv, pid_file, _, stop = procs.writer(name, "escape")
    job = start(d, argv)
    escapee = procs.wait_pid(pid_file)
    return wait_job(d, job.id, "the leader's exit to be seen", running_without_leader(escapee)), escapee, stop


def test_orphans_reparent_to_the_jobs_keeper_and_are_reaped(tmp_path: Path, procs: Procs) -> None:
    with running(tmp_path) as d:
        assert d.proc is not None
        sidecar = d.proc.pid
        job, escapee, stop = escaped_job(d, procs, "orphan")
        # The job's keeper is a subreaper: the orphan is its child now, not init's; the keeper is
        # the sidecar's child and is never counted as one of the job's processes.
        keeper = int(_stat(escapee)[1])
        assert int(_stat(keeper)[1]) == sidecar
        assert keeper not in job.live_pids and keeper != job.pid
        stop.touch()
        wait_job(d, job.id, "the job to end", lambda j: j.state == pb.JOB_STATE_EXITED)
        # The keeper exits with the job's last process, and the sidecar reaps it.
        wait_until(lambda: not children_of(sidecar, zombies=True), timeout=DEADLINE_S, what="no zombies")
        assert not Path(f"/proc/{escapee}").exists() and not Path(f"/proc/{keeper}").exists()


def test_a_killed_keeper_leaves_the_jobs_orphans_to_the_sidecar(tmp_path: Path, procs: Procs) -> None:
    """Killing the keeper (the job may do it: it runs as the same user) loses nothing: its orphans
    go to the sidecar, itself a subreaper, and the job is followed by its tag and records."""
    with running(tmp_path) as d:
        assert d.proc is not None
        sidecar = d.proc.pid
        job, escapee, stop = escaped_job(d, procs, "nokeeper")
        status = Path(job.log_path).with_suffix(".exit")  # the keeper writes it as it reaps the leader
        wait_until(status.exists, timeout=DEADLINE_S, what="the leader's recorded status")
        keeper = int(_stat(escapee)[1])
        os.kill(keeper, signal.SIGKILL)  # our grandchild, alive: its PID is its own
        wait_until(
            lambda: int(_stat(escapee)[1]) == sidecar, timeout=DEADLINE_S, what="the sidecar to inherit it"
        )
        again = listed(d, job.id)
        assert again.state == pb.JOB_STATE_RUNNING and list(again.live_pids) == [escapee]
        stop.touch()
        done = wait_job(d, job.id, "the job to end", lambda j: j.state != pb.JOB_STATE_RUNNING)
        assert (done.state, done.exit_code) == (pb.JOB_STATE_EXITED, 0)
        wait_until(lambda: not children_of(sidecar, zombies=True), timeout=DEADLINE_S, what="no zombies")


class MemoryStore:
    def __init__(self) -> None:
        self.saved: dict[str, JobRecord] = {}

    def save_job(self, job: JobRecord) -> None:
        self.saved[job.id] = job

    def load_jobs(self) -> list[JobRecord]:
        return list(self.saved.values())


def test_running_is_answered_from_a_fresh_scan_without_pidfds(
    tmp_path: Path, procs: Procs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No poll tick has to pass: the gate's question scans /proc when it is asked."""
    argv, pid_file, _, stop = procs.writer("fresh", "plain")
    store = MemoryStore()
    # No poll tick comes during the test: only the scan of running_now() can see the change.
    monkeypatch.setattr("sidecar.jobs._POLL_INTERVAL_S", 3600.0)
    monkeypatch.setattr("sidecar.jobs._TREE_POLL_S", 3600.0)

    async def main() -> None:
        sup = JobSupervisor(store, tmp_path / "logs", tmp_path, lambda *event: None, use_pidfd=False)
        try:
            job = await sup.start(["sh", "-c", '"$@" & exit 0', "sh", *argv])
            writer = procs.wait_pid(pid_file)
            await until_scanned(
                sup, "the leader's exit", lambda running: running and sup.get(job.id).leader_exited
            )
            assert sup.get(job.id).live_pids == [writer]
            assert store.saved[job.id].leader_exited and store.saved[job.id].exit_code == 0
            stop.touch()
            # Its keeper reaps it, records the job's end and exits: then no job runs.
            await until_scanned(sup, "the job to end", lambda running: not running)
            assert not pid_alive(writer)
            done = sup.get(job.id)
            assert (done.state, done.exit_code, done.live_pids) == ("exited", 0, [])
        finally:
            for j in sup.running():
                await sup.stop(j.id, grace_s=0)
            await sup.close()

    asyncio.run(main())
