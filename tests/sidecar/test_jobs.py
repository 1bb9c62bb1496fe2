"""JobSupervisor against real processes and real /proc: start, exit codes, stop, groups, recovery."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import sidecar.jobs
import sidecar.spawn
from sidecar import children, proctree
from sidecar.errors import NotFoundError, PreconditionError
from sidecar.jobs import JOB_EXITED, JOB_STARTED, JobRecord, JobSupervisor
from tests.conftest import children_of, wait_until

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 15.0


class MemoryStore:
    """The JobStore protocol in a dict; the ledger does the same durably."""

    def __init__(self, jobs: list[JobRecord] | None = None) -> None:
        self.saved: dict[str, JobRecord] = {j.id: j for j in jobs or []}

    def save_job(self, job: JobRecord) -> None:
        self.saved[job.id] = job

    def load_jobs(self) -> list[JobRecord]:
        return list(self.saved.values())


class Events:
    """Collects emitted events; lets a test await one with a deadline."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, str]] = []
        self._changed = asyncio.Event()

    def __call__(self, kind: str, job_id: str, detail: str) -> None:
        self.items.append((kind, job_id, detail))
        self._changed.set()

    def of(self, job_id: str) -> list[tuple[str, str]]:
        return [(k, d) for k, j, d in self.items if j == job_id]

    async def wait(self, kind: str, job_id: str, timeout: float = DEADLINE_S) -> str:
        async with asyncio.timeout(timeout):
            while True:
                for k, j, d in self.items:
                    if k == kind and j == job_id:
                        return d
                self._changed.clear()
                await self._changed.wait()


async def until(what: str, predicate: Callable[[], bool], timeout: float = DEADLINE_S) -> None:
    """Await a condition (a file's content, typically) with a deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def until_scanned(
    sup: JobSupervisor, what: str, predicate: Callable[[list[JobRecord]], object], timeout: float = DEADLINE_S
) -> None:
    """Await a condition on the running jobs as a fresh scan (off the loop) shows them (a scan that
    does not answer yet, as one that was stuck, is looked at again)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate(await sup.running_now()):
                return
        except PreconditionError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def wait_gone(pid: int, timeout: float = DEADLINE_S) -> None:
    """Await the end of any process (zombies count as ended) through a pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ended.done():
            ended.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await asyncio.wait_for(ended, timeout)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def start_ticks(pid: int) -> int:
    """Field 22 of /proc/PID/stat, parsed independently of the code under test."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text.rsplit(")", 1)[1].split()[19])


def is_alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return text.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


# pidfd readiness is the normal path; polling is the fallback where pidfds are unavailable.
WATCH_MODES = pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "polling"])

Body = Callable[[JobSupervisor, Events], Awaitable[None]]


def run_supervised(
    tmp_path: Path, body: Body, store: MemoryStore | None = None, *, use_pidfd: bool = True
) -> None:
    async def main() -> None:
        events = Events()
        sup = JobSupervisor(store or MemoryStore(), tmp_path / "logs", tmp_path, events, use_pidfd=use_pidfd)
        try:
            await body(sup, events)
        finally:
            for job in sup.running():  # a failed test must not leak processes
                await sup.stop(job.id, grace_s=0)
            await sup.close()

    asyncio.run(main())


def record(job_id: str, pid: int, ticks: int, state: str = "running") -> JobRecord:
    return JobRecord(
        id=job_id,
        cell="c1",
        argv=["trainer"],
        cwd="/",
        env={},
        pid=pid,
        pgid=pid,
        state=state,
        exit_code=None,
        started_at_ns=time.time_ns(),
        ended_at_ns=None,
        log_path="/dev/null",
        proc_start_ticks=ticks,
    )


@WATCH_MODES
def test_exit_code_log_and_events(tmp_path: Path, use_pidfd: bool) -> None:
    store = MemoryStore()

    async def body(sup: JobSupervisor, events: Events) -> None:
        job = await sup.start(py("print('hi'); import sys; sys.exit(3)"), cell="lr-1e-3")
        assert job.state == "running"
        assert job.pgid == job.pid != os.getpgrp()
        assert job.proc_start_ticks > 0
        assert await events.wait(JOB_EXITED, job.id) == "3"
        done = sup.get(job.id)
        assert (done.state, done.exit_code, done.cell) == ("exited", 3, "lr-1e-3")
        assert done.ended_at_ns is not None and done.ended_at_ns >= done.started_at_ns
        assert events.of(job.id)[0][0] == JOB_STARTED
        assert store.saved[job.id] == done
        log = sup.log_path(job.id)
        assert log.read_text() == "hi\n"
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert sup.log_size(job.id) == 3
        assert sup.running() == []

    run_supervised(tmp_path, body, store, use_pidfd=use_pidfd)


def test_cwd_env_and_listing(tmp_path: Path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()

    async def body(sup: JobSupervisor, events: Events) -> None:
        first = await sup.start(
            py("import os; print(os.getcwd(), os.environ['BW_X'])"), cwd=workdir, env={"BW_X": "42"}
        )
        second = await sup.start(py("pass"))
        await events.wait(JOB_EXITED, first.id)
        await events.wait(JOB_EXITED, second.id)
        assert sup.log_path(first.id).read_text() == f"{workdir} 42\n"
        assert first.env == {"BW_X": "42"}  # the inherited environment is not recorded
        assert first.cwd == str(workdir) and second.cwd == str(tmp_path)
        assert [j.id for j in sup.jobs()] == [second.id, first.id]
        with pytest.raises(NotFoundError):
            sup.get("j-nope")

    run_supervised(tmp_path, body)


def test_stop_sends_sigterm_to_the_group(tmp_path: Path) -> None:
    async def body(sup: JobSupervisor, events: Events) -> None:
        job = await sup.start(py("import time; time.sleep(60)"))
        assert os.getpgid(job.pid) == job.pid == os.getsid(job.pid)
        assert os.getpgid(job.pid) != os.getpgrp()
        assert [j.id for j in sup.running()] == [job.id]
        stopped = await sup.stop(job.id, grace_s=10)
        assert (stopped.state, stopped.exit_code) == ("stopped", -signal.SIGTERM)
        assert await events.wait(JOB_EXITED, job.id) == "-15"
        assert await sup.stop(job.id) == stopped  # already ended: unchanged
        with pytest.raises(NotFoundError):
            await sup.stop("j-nope")

    run_supervised(tmp_path, body)


@WATCH_MODES
def test_stop_kills_a_job_that_ignores_sigterm_after_the_grace(tmp_path: Path, use_pidfd: bool) -> None:
    async def body(sup: JobSupervisor, events: Events) -> None:
        job = await sup.start(
            py("""
                import signal, time
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                print("ready", flush=True)
                time.sleep(60)
            """)
        )
        await until("the ready line", lambda: "ready" in sup.log_path(job.id).read_text())
        t0 = time.monotonic()
        stopped = await sup.stop(job.id, grace_s=0.5)
        assert time.monotonic() - t0 >= 0.5
        assert (stopped.state, stopped.exit_code) == ("stopped", -signal.SIGKILL)
        assert await events.wait(JOB_EXITED, job.id) == "-9"

    run_supervised(tmp_path, body, use_pidfd=use_pidfd)


def test_stop_kills_children_in_the_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"

    async def body(sup: JobSupervisor, events: Events) -> None:
        job = await sup.start(
            py(f"""
                import os, subprocess, sys, time
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                with open({str(pid_file)!r} + ".tmp", "w") as f:
                    f.write(str(child.pid))
                os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
                time.sleep(60)
            """)
        )
        await until("the child's pid file", pid_file.exists)
        child = int(pid_file.read_text())
        assert os.getpgid(child) == job.pgid
        stopped = await sup.stop(job.id, grace_s=5)
        assert stopped.state == "stopped"
        await wait_gone(child)
        assert not is_alive(child)

    run_supervised(tmp_path, body)


def test_start_preconditions(tmp_path: Path) -> None:
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\n")

    async def body(sup: JobSupervisor, events: Events) -> None:
        with pytest.raises(PreconditionError, match="not found on the job's PATH"):
            await sup.start(["boxwarden-no-such-program"])
        with pytest.raises(PreconditionError, match="not an existing directory"):
            await sup.start([sys.executable, "-V"], cwd=tmp_path / "missing")
        with pytest.raises(PreconditionError, match="argv is empty"):
            await sup.start([])
        with pytest.raises(PreconditionError, match="not an executable file"):
            await sup.start(["./not-executable.sh"])
        # Executable, but exec() fails (no "#!", not a binary): the keeper says why.
        garbage = tmp_path / "garbage"
        garbage.write_bytes(b"\x7fELF-not-really")
        garbage.chmod(0o755)
        with pytest.raises(PreconditionError, match=r"cannot start './garbage': .*Exec format error"):
            await sup.start(["./garbage"])
        assert sup.jobs() == [] and events.items == []
        assert not children_of(os.getpid(), zombies=True)  # the keeper that reported it was reaped

    run_supervised(tmp_path, body)


@pytest.mark.parametrize(
    ("keeper", "why"),
    [
        ("import time; time.sleep(60)", "its keeper .* did not report within 1s"),
        ("import sys; sys.exit(7)", r"its keeper exited \(7\) without starting it"),
    ],
    ids=["silent", "died"],
)
def test_a_keeper_that_never_reports_fails_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keeper: str, why: str
) -> None:
    fake = tmp_path / "keeper.py"
    fake.write_text(keeper)
    monkeypatch.setattr("sidecar.spawn.KEEPER", fake)
    monkeypatch.setattr("sidecar.spawn.KEEPER_REPORT_S", 1.0)

    async def body(sup: JobSupervisor, events: Events) -> None:
        with pytest.raises(PreconditionError, match=why):
            await sup.start(py("import time; time.sleep(60)"))
        assert sup.jobs() == [] and events.items == []
        assert not children_of(os.getpid(), zombies=True)  # killed if need be, and reaped

    run_supervised(tmp_path, body)


def self_stopping_keeper(tmp_path: Path) -> Path:
    """A keeper that stops itself (SIGSTOP) before anything else, then runs the real one."""
    real = sidecar.spawn.KEEPER
    path = tmp_path / "keeper.py"
    path.write_text(
        "import os, runpy, signal, sys\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
        f"sys.argv[0] = {str(real)!r}\n"
        f"runpy.run_path({str(real)!r}, run_name='__main__')\n"
    )
    return path


def test_a_stopped_keeper_is_woken_so_that_stop_job_ends_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped keeper reaps nothing and reports nothing: the job (same user) can stop it."""
    real = sidecar.spawn.KEEPER
    stops_itself = self_stopping_keeper(tmp_path)

    async def body(sup: JobSupervisor, events: Events) -> None:
        monkeypatch.setattr("sidecar.spawn.KEEPER", stops_itself)
        job = await sup.start(py("import time; time.sleep(60)"))  # woken: it reported in time
        monkeypatch.setattr("sidecar.spawn.KEEPER", real)
        assert job.state == "running" and is_alive(job.pid)
        keeper = job.keeper[0]
        os.kill(keeper, signal.SIGSTOP)  # again, now that it runs: our own child, the PID is its
        wait_until_state(keeper, "T")
        stopped = await sup.stop(job.id, grace_s=5)
        assert (stopped.state, stopped.exit_code) == ("stopped", -signal.SIGTERM)
        await wait_gone(keeper)
        # A job that stops its own keeper and exits: the next look wakes the keeper, the job ends.
        job = await sup.start(["sh", "-c", "kill -STOP $PPID; exit 3"])
        await until_scanned(sup, "the job to end", lambda running: not running)
        assert (sup.get(job.id).state, sup.get(job.id).exit_code) == ("exited", 3)

    run_supervised(tmp_path, body)


def test_a_job_is_starting_until_recorded_and_recorded_even_if_its_caller_gives_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the keeper's start and the job's record the leader may already run: the job is
    "starting" (a release refuses), and a cancelled StartJob still records it (it runs)."""
    # It stops itself before it reports (and is woken): the start takes a while.
    monkeypatch.setattr("sidecar.spawn.KEEPER", self_stopping_keeper(tmp_path))

    async def body(sup: JobSupervisor, events: Events) -> None:
        caller = asyncio.ensure_future(sup.start(py("import time; time.sleep(60)")))
        await until("the start to begin", lambda: bool(sup.starting()))
        (job_id,) = sup.starting()
        assert sup.jobs() == []
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert await events.wait(JOB_STARTED, job_id)
        assert sup.starting() == []
        job = sup.get(job_id)
        assert job.state == "running" and is_alive(job.pid)

    run_supervised(tmp_path, body)


def test_an_exit_file_written_by_the_job_itself_is_not_its_status(tmp_path: Path) -> None:
    async def body(sup: JobSupervisor, events: Events) -> None:
        logs = tmp_path / "logs"
        job = await sup.start(["sh", "-c", f'echo 7 > {logs}/"$BOXWARDEN_JOB_ID".exit; exec sleep 60'])
        forged = logs / f"{job.id}.exit"
        await until("the job to write it", lambda: forged.exists() and forged.read_text() == "7\n")
        (seen,) = await sup.jobs_now(strict=True)
        assert (seen.leader_exited, seen.exit_code, seen.live_pids) == (False, None, [job.pid])
        stopped = await sup.stop(job.id, grace_s=5)
        assert (stopped.state, stopped.exit_code) == ("stopped", -signal.SIGTERM)

    run_supervised(tmp_path, body)


def test_a_keeper_gone_without_the_jobs_end_holds_the_job_unless_the_box_rebooted(tmp_path: Path) -> None:
    with subprocess.Popen(py("pass")) as dead:
        pass  # exited and reaped: its pid names no process now
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    logs = tmp_path / "logs"
    logs.mkdir()

    def kept(job_id: str, boot_id: str, exit_text: str | None) -> JobRecord:
        job = dataclasses.replace(
            record(job_id, dead.pid, 12345),
            keeper=[dead.pid, 12340],
            boot_id=boot_id,
            log_path=str(logs / f"{job_id}.log"),
        )
        if exit_text is not None:
            job.exit_path.write_text(exit_text)
        return job

    store = MemoryStore(
        [
            kept("jkilled", boot, None),  # killed before its leader ended
            kept("jkilled2", boot, "0\n"),  # killed after its leader ended, before the last process
            kept("jended", boot, "3\nend\n"),  # recorded the end: ended while we were away
            kept("jreboot", "another-boot", None),  # nothing outlives a reboot
        ]
    )

    async def body(sup: JobSupervisor, events: Events) -> None:
        await sup.recover()
        running = {j.id: j for j in sup.running()}
        assert set(running) == {"jkilled", "jkilled2"}
        assert all(j.keeper_lost for j in running.values()) and store.saved["jkilled"].keeper_lost
        assert (sup.get("jended").state, sup.get("jended").exit_code) == ("exited", 3)
        assert sup.get("jreboot").state == "lost"
        stopped = await sup.stop("jkilled", grace_s=1)
        assert stopped.state == "stopped"
        assert [j.id for j in sup.running()] == ["jkilled2"]

    run_supervised(tmp_path, body, store)


def wait_until_state(pid: int, state: str) -> None:
    def now() -> bool:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == state

    wait_until(now, what=f"pid {pid} in state {state}")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_keeper_holds_the_job_and_is_not_part_of_it(tmp_path: Path) -> None:
    """The leader is the keeper's child, in a session of its own; the keeper works in "/", is
    the sidecar's child, is never one of the job's processes, and ends with the job."""

    async def body(sup: JobSupervisor, events: Events) -> None:
        job = await sup.start(py("import time; time.sleep(60)"))
        keeper, ticks = job.keeper
        assert ticks == start_ticks(keeper) and keeper != job.pid
        assert parent_of(job.pid) == keeper and parent_of(keeper) == os.getpid()
        assert os.readlink(f"/proc/{keeper}/cwd") == "/"
        # `pkill -f time.sleep` must not hit it, nor a SIGTERM meant for the job end it.
        assert b"time.sleep" not in Path(f"/proc/{keeper}/cmdline").read_bytes()
        assert not list((tmp_path / "logs").glob("*.spec"))  # read and removed
        os.kill(keeper, signal.SIGTERM)
        os.kill(keeper, signal.SIGHUP)
        assert (await sup.jobs_now(strict=True))[0].state == "running" and is_alive(keeper)
        assert os.getsid(job.pid) == job.pid != os.getsid(keeper)
        (listed,) = await sup.jobs_now(strict=True)  # scanned now
        assert listed.live_pids == [job.pid]
        stopped = await sup.stop(job.id, grace_s=5)
        # It outlived those signals: it reaped the leader, recorded its status and the job's end.
        assert (stopped.state, stopped.exit_code) == ("stopped", -signal.SIGTERM)
        assert stopped.keeper_ended() and not stopped.keeper_lost
        await wait_gone(keeper)
        assert not children_of(os.getpid(), zombies=True)

    run_supervised(tmp_path, body)


@WATCH_MODES
def test_recover_watches_a_live_job_until_it_is_lost(tmp_path: Path, use_pidfd: bool) -> None:
    with subprocess.Popen(py("import time; time.sleep(60)"), start_new_session=True) as proc:
        store = MemoryStore([record("jlive", proc.pid, start_ticks(proc.pid))])

        async def body(sup: JobSupervisor, events: Events) -> None:
            await sup.recover()
            assert sup.get("jlive").state == "running"
            assert events.items == []
            proc.kill()
            assert await events.wait(JOB_EXITED, "jlive") == "lost"
            lost = sup.get("jlive")
            assert (lost.state, lost.exit_code) == ("lost", None)
            assert lost.ended_at_ns is not None
            assert store.saved["jlive"] == lost

        run_supervised(tmp_path, body, store, use_pidfd=use_pidfd)


def test_recover_marks_dead_and_reused_pids_lost(tmp_path: Path) -> None:
    with subprocess.Popen(py("pass")) as dead:
        pass  # exited and reaped: its pid names no process now
    # Registered like every child the sidecar starts itself: not an orphan some job left behind.
    with children.popen(py("import time; time.sleep(60)"), start_new_session=True) as other:
        ended = dataclasses.replace(record("jold", 1, 1, state="exited"), exit_code=0, ended_at_ns=1)
        store = MemoryStore(
            [
                record("jdead", dead.pid, 12345),
                record("jreused", other.pid, start_ticks(other.pid) + 1),
                ended,
            ]
        )

        async def body(sup: JobSupervisor, events: Events) -> None:
            await sup.recover()
            for job_id in ("jdead", "jreused"):
                assert sup.get(job_id).state == "lost"
                assert store.saved[job_id].state == "lost"
                assert events.of(job_id) == [(JOB_EXITED, "lost")]
            assert sup.get("jold") == ended
            assert sup.running() == []
            assert other.poll() is None  # a PID that is not our job's is never signalled

        try:
            run_supervised(tmp_path, body, store)
        finally:
            other.kill()
            other.wait()
            children.release(other.pid)


SIDECAR_RUN = """
import asyncio, dataclasses, json, sys
from pathlib import Path
from sidecar.jobs import JobSupervisor

class Store:
    def save_job(self, job): self.job = job
    def load_jobs(self): return []

async def main():
    store, state = Store(), Path(sys.argv[1])
    sup = JobSupervisor(store, state, state, lambda *event: None)
    await sup.start([sys.executable, "-c", "import time; time.sleep(60)"])
    await sup.close()
    print(json.dumps(dataclasses.asdict(store.job)))

asyncio.run(main())
"""


def test_jobs_survive_a_sidecar_restart_and_can_be_stopped_after_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", SIDECAR_RUN, str(tmp_path)],
        env=env,
        capture_output=True,
        check=True,
        text=True,
    )
    job = JobRecord(**json.loads(out.stdout))
    # The first sidecar has exited; its job still runs, and its PID still names it.
    assert is_alive(job.pid) and start_ticks(job.pid) == job.proc_start_ticks

    async def body(sup: JobSupervisor, events: Events) -> None:
        await sup.recover()
        assert sup.get(job.id).state == "running"
        stopped = await sup.stop(job.id, grace_s=5)
        # Not our child any more, but its keeper recorded the status: our SIGTERM ended it.
        assert (stopped.state, stopped.exit_code) == ("stopped", -signal.SIGTERM)
        assert await events.wait(JOB_EXITED, job.id) == str(-signal.SIGTERM)
        await wait_gone(job.pid)

    run_supervised(tmp_path, body, MemoryStore([job]))


def test_a_stray_scan_stuck_in_the_kernel_names_the_process_and_never_freezes_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 10, finding 2: a stat through the cwd of a process on a dead FUSE or network mount
    blocks in the kernel; the scan ran on the event loop and froze the whole sidecar. It runs in a
    thread now, with a deadline: here it blocks (as such a stat does) on one process."""
    release = threading.Event()
    real = sidecar.strays._works_there
    sleeper = subprocess.Popen(["sleep", "600"], cwd="/")

    def blocks_on_it(pid: int, where: object) -> str:
        if pid == sleeper.pid:
            release.wait(60)
        return real(pid, where)  # type: ignore[arg-type]

    monkeypatch.setattr("sidecar.strays._works_there", blocks_on_it)
    monkeypatch.setattr("sidecar.jobs._STRAY_SCAN_S", 0.5)

    async def body(sup: JobSupervisor, events: Events) -> None:
        try:
            (stuck,) = await sup.strays([str(tmp_path)])
            assert stuck.pid == sleeper.pid and "could not be looked at" in stuck.why
            threads = threading.active_count()
            # Still stuck: the next scan says so at once, and starts no second thread.
            (again,) = await sup.strays([str(tmp_path)])
            assert again.pid == sleeper.pid and threading.active_count() == threads
        finally:
            release.set()
        await until("the stuck scan to finish", lambda: sup._stuck is None or sup._stuck[0].done())
        assert await sup.strays([str(tmp_path)]) == []

    try:
        run_supervised(tmp_path, body)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_scan_of_proc_that_hangs_never_blocks_the_loop_and_the_gates_question_fails_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 9, item 8: every scan of /proc ran on the event loop (the health sample, ListJobs, the
    release check): a read stuck in the kernel (a process's environ while its memory map is locked)
    would have frozen every RPC. Scans now run on a thread with a deadline."""
    monkeypatch.setattr(sidecar.jobs, "_SCAN_S", 0.5)
    hang, entered, release = threading.Event(), threading.Event(), threading.Event()

    def scan() -> proctree.ProcTable:
        if hang.is_set():
            entered.set()
            release.wait(30)  # a fake that blocks for up to 30 s
        return proctree.scan()

    async def main() -> None:
        sup = JobSupervisor(MemoryStore(), tmp_path / "logs", tmp_path, Events(), scan=scan)
        job = await sup.start(py("import time; time.sleep(60)"))
        try:
            assert [j.id for j in await sup.running_now()] == [job.id]
            state = sup.scan_state()
            assert state is not None and not state.stale
            hang.set()
            pending = asyncio.ensure_future(sup.jobs_now())
            # The loop turns while the scan hangs on its thread: this await returns.
            await until("the scan to hang", entered.is_set)
            (listed,) = await pending  # by the deadline, with the last state
            assert (listed.id, listed.state) == (job.id, "running")
            state = sup.scan_state()
            assert state is not None and state.stale and "no answer" in state.error
            with pytest.raises(PreconditionError, match="did not answer"):
                await sup.running_now()  # the gate's question: refused, never "not running"
            release.set()
            hang.clear()
            await until_scanned(sup, "a fresh scan", lambda running: [j.id for j in running] == [job.id])
            state = sup.scan_state()
            assert state is not None and not state.stale
        finally:
            release.set()
            hang.clear()
            await sup.stop(job.id, grace_s=1)
            await sup.close()

    asyncio.run(main())


def test_a_job_restarted_while_the_release_scans_is_still_in_its_way(tmp_path: Path) -> None:
    """Review of the /proc scan change: the release's lines were read at two moments (the running
    jobs before the stray scan, the restarting ones after it): a job whose restart came during the
    scan was in neither, and the release went on while it ran."""
    from sidecar.app import jobs_in_the_way

    slow = threading.Event()

    def scan() -> proctree.ProcTable:
        if slow.is_set():
            time.sleep(1.5)  # a slow scan (a big /proc): the restart's backoff ends during it
        return proctree.scan()

    async def main() -> None:
        sup = JobSupervisor(MemoryStore(), tmp_path / "logs", tmp_path, Events(), scan=scan)
        job = await sup.start(
            py("import time, sys; time.sleep(0.2); sys.exit(1)"),
            restart="on-failure",
            max_restarts=3,
            backoff_s=0.5,
        )
        try:
            await until_scanned(sup, "its first run to fail", lambda _: bool(sup.restart_pending()))
            slow.set()
            lines = await jobs_in_the_way(sup, list, [str(tmp_path)], None)
            slow.clear()
            assert any(job.id in r.detail for r in lines), (lines, sup.get(job.id).state)
        finally:
            slow.clear()
            await sup.stop(job.id, grace_s=0)
            await sup.close()

    asyncio.run(main())


def test_a_jobs_end_is_seen_even_when_the_second_look_does_not_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: the first look saw the keeper gone, the second missed its deadline: the job was left
    with neither a pidfd nor a poll, "running" until some other caller happened to scan."""
    monkeypatch.setattr(sidecar.jobs, "_SCAN_S", 0.3)
    looks: list[int] = []
    armed = threading.Event()

    def scan() -> proctree.ProcTable:
        table = proctree.scan()
        if armed.is_set():
            looks.append(1)
            if len(looks) == 2:
                time.sleep(1.0)  # only the second look after the job's end is late
        return table

    async def main() -> None:
        sup = JobSupervisor(MemoryStore(), tmp_path / "logs", tmp_path, Events(), scan=scan)
        job = await sup.start(py("import time; time.sleep(0.5)"))
        armed.set()  # the next scan is the pidfd's, once the job ends
        try:
            await until(
                "the job's end, seen by the supervisor alone", lambda: sup.get(job.id).state == "exited"
            )
        finally:
            await sup.close()

    asyncio.run(main())


def test_stop_job_reads_no_environ_on_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review: StopJob's signalling scanned /proc on the loop and read the environ of every process
    new to it there; one whose read hangs (its memory map locked) would have frozen every RPC."""
    victim: dict[str, int] = {"pid": -1}
    read_on: list[str] = []
    real = proctree._read_tag

    def read_tag(pid: int) -> str | None:
        if pid == victim["pid"]:
            read_on.append(threading.current_thread().name)
            time.sleep(1.0)  # a slow read of a new process's environ
        return real(pid)

    monkeypatch.setattr(proctree, "_read_tag", read_tag)

    async def main() -> None:
        sup = JobSupervisor(MemoryStore(), tmp_path / "logs", tmp_path, Events())
        job = await sup.start(py("import time; time.sleep(60)"))
        other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # new since the last scan
        try:
            await sup.jobs_now(strict=True)
            read_on.clear()
            victim["pid"] = other.pid  # (its tag is cached now: forget it, as for a process new to the stop)
            sup._tags = proctree.TagReader()
            stopped = await sup.stop(job.id, grace_s=1)
            assert stopped.state == "stopped"
            assert read_on and threading.main_thread().name not in read_on, read_on
        finally:
            other.kill()
            other.wait()
            await sup.close()

    asyncio.run(main())


def test_stop_job_terms_every_process_once_a_scan_answers_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: when StopJob's first scan did not answer, only the job's group got SIGTERM; a process
    of the job in a session of its own got nothing until the SIGKILL at the grace's end (no chance
    to save a checkpoint), though scans answered again long before."""
    monkeypatch.setattr(sidecar.jobs, "_SCAN_S", 0.3)
    said = tmp_path / "child.txt"
    slow = threading.Event()

    def scan() -> proctree.ProcTable:
        table = proctree.scan()
        if slow.is_set():
            slow.clear()
            time.sleep(0.8)  # one scan misses its deadline; the next ones answer
        return table

    child = textwrap.dedent(
        f"""
        import signal, sys, time
        def term(*_):
            open({str(said)!r}, "a").write("TERM\\n"); sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        open({str(said)!r}, "a").write("up\\n")
        while True: time.sleep(1)
        """
    )
    leader = (
        f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}], "
        "start_new_session=True); time.sleep(60)"
    )

    async def main() -> None:
        sup = JobSupervisor(MemoryStore(), tmp_path / "logs", tmp_path, Events(), scan=scan)
        job = await sup.start([sys.executable, "-c", leader])
        try:
            await until("the job's own-session child", lambda: said.exists() and "up" in said.read_text())
            await until_scanned(sup, "the child in the job", lambda running: len(running[0].live_pids) == 2)
            slow.set()
            stopped = await sup.stop(job.id, grace_s=30)  # ends well before: every process had SIGTERM
            assert stopped.state == "stopped"
            assert said.read_text().split() == ["up", "TERM"]
        finally:
            await sup.close()

    asyncio.run(main())
