"""The windows where a sidecar dies between starting a job's processes and recording them, and what
the next sidecar does: the processes are found by their tag and followed, never started a second
time; and a start that fails with an OSError (a full disk) fails its cell instead of stalling the
queue. The first sidecar is a real process killed at the store boundary (os._exit as its record is
saved: a power cut at the worst moment); the second is the real JobSupervisor and QueueRunner on the
same ledger, with real jobs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sidecar.cellqueue import QueueRunner
from sidecar.jobs import JobSupervisor
from sidecar.ledger import Ledger
from sidecar.queuerecord import CellEvidence, Entry
from tests.conftest import REPO, wait_until
from tests.sidecar.test_jobs import Events, until
from tests.test_gate_reasons import tiny_tmpfs  # noqa: F401 - the fixture

# A run of a job: appends its pid to <runs>, fails the first time, later waits for <gate> (a minute
# at most) and exits 0.
RUN = r"""
import os, sys, time
runs, gate = sys.argv[1], sys.argv[2]
n = len(open(runs).read().split()) if os.path.exists(runs) else 0
open(runs, "a").write("%d\n" % os.getpid())
if n == 0 and sys.argv[3] == "fail-first":
    sys.exit(1)
deadline = time.monotonic() + 60
while not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(0)
"""

# The first sidecar: it dies (os._exit) when it saves the record `CRASH_WHEN` picks.
FIRST = r"""
import asyncio, os, sys
from pathlib import Path
from sidecar.cellqueue import QueueRunner
from sidecar.queuerecord import CellEvidence, Entry
from sidecar.jobs import JobSupervisor
from sidecar.ledger import Ledger

tmp, mode, run = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

class Dies(Ledger):
    def save_job(self, job):
        restarted = mode == "restart" and job.state == "running" and job.restarts >= 1
        queued = mode == "queue" and job.cell == "a" and job.state == "running"
        if restarted or queued:
            os._exit(9)
        super().save_job(job)

async def main():
    ledger = Dies(tmp / "ledger.db")
    sup = JobSupervisor(ledger, tmp / "logs", tmp, lambda *a: None)
    await sup.recover()
    if mode == "restart":
        argv = [sys.executable, "-c", run, str(tmp / "a.runs"), str(tmp / "a.gate"), "fail-first"]
        await sup.start(argv, cell="a", restart="on-failure", max_restarts=3, backoff_s=0.05)
    else:
        evidence = lambda cells: {c: CellEvidence(1, 1, 0) for c in cells}
        queues = QueueRunner(ledger, sup, lambda kind, detail: None, evidence, settle_s=0)
        def argv(c):
            return [sys.executable, "-c", run, str(tmp / (c + ".runs")), str(tmp / (c + ".gate")), "-"]
        cells = [Entry(cell=c, argv=argv(c)) for c in "ab"]
        await queues.start("q", cells)
    await asyncio.sleep(60)  # killed long before this

asyncio.run(main())
"""


def first_sidecar_dies(tmp_path: Path, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
    r = subprocess.run(
        [sys.executable, "-c", FIRST, str(tmp_path), mode, RUN],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 9, r.stderr


def all_durable(cells: Any) -> dict[str, CellEvidence]:
    return {c: CellEvidence(1, 1, 0) for c in cells}


def pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def second_sidecar(tmp_path: Path, body: Callable[[JobSupervisor, QueueRunner], Awaitable[None]]) -> None:
    async def main() -> None:
        ledger = Ledger(tmp_path / "ledger.db")
        sup = JobSupervisor(ledger, tmp_path / "logs", tmp_path, Events())
        queues = QueueRunner(ledger, sup, lambda kind, detail: None, all_durable, settle_s=0)
        try:
            await sup.recover()
            await queues.recover()
            await body(sup, queues)
        finally:
            for name in "ab":
                (tmp_path / f"{name}.gate").touch()
            await queues.close()
            for job in sup.running():
                await sup.stop(job.id, grace_s=0)
            await sup.close()
            ledger.close()

    try:
        asyncio.run(main())
    finally:
        for name in "ab":  # whatever happened, nothing of this test runs on
            (tmp_path / f"{name}.gate").touch()
            for pid in pids(tmp_path / f"{name}.runs"):
                if alive(pid):
                    os.kill(pid, 9)


def test_a_restart_the_last_sidecar_did_not_record_is_followed_not_started_again(tmp_path: Path) -> None:
    first_sidecar_dies(tmp_path, "restart")
    # The restart's leader runs (its keeper said so before the record was saved): it writes its pid.
    # The failed run, and the restart that now runs.
    first, second = wait_until(lambda: len(p := pids(tmp_path / "a.runs")) == 2 and p)
    assert not alive(first) and alive(second)

    async def body(sup: JobSupervisor, queues: QueueRunner) -> None:
        (job,) = sup.running()
        assert (job.pid, job.restarts, job.restart_at_ns) == (second, 1, 0)
        assert sup.restart_pending() == []  # nothing armed: it runs already
        (tmp_path / "a.gate").touch()
        await until("the restarted run to end", lambda: sup.settled(job.id), timeout=30)
        ended = sup.get(job.id)
        assert (ended.state, ended.exit_code) == ("exited", 0)  # its status, from its keeper

    second_sidecar(tmp_path, body)
    assert pids(tmp_path / "a.runs") == [first, second]  # never a third run


def test_a_queued_cell_the_last_sidecar_did_not_record_is_followed_before_the_next_starts(
    tmp_path: Path,
) -> None:
    first_sidecar_dies(tmp_path, "queue")
    (running,) = wait_until(lambda: pids(tmp_path / "a.runs"))
    assert alive(running) and not pids(tmp_path / "b.runs")

    async def body(sup: JobSupervisor, queues: QueueRunner) -> None:
        q = queues.get("q")
        assert [e.state for e in q.entries] == ["running", "pending"]
        assert [j.pid for j in sup.running()] == [running]  # followed: it holds the gate too
        assert not pids(tmp_path / "b.runs")  # b waits for it
        (tmp_path / "a.gate").touch()
        (tmp_path / "b.gate").touch()
        await until("the queue to end", lambda: not queues.get("q").active, timeout=30)
        assert [(e.state, e.exit_code) for e in q.entries] == [("done", 0), ("done", 0)]

    second_sidecar(tmp_path, body)
    assert len(pids(tmp_path / "a.runs")) == len(pids(tmp_path / "b.runs")) == 1


def test_a_start_that_fails_on_a_full_disk_fails_its_cell_and_the_queue_goes_on(
    tmp_path: Path,
    tiny_tmpfs: Path,  # noqa: F811
) -> None:
    fd = os.open(tiny_tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass  # full
    finally:
        os.close(fd)

    async def main() -> None:
        ledger = Ledger(tmp_path / "ledger.db")
        sup = JobSupervisor(ledger, tiny_tmpfs / "logs", tmp_path, Events())
        queues = QueueRunner(ledger, sup, lambda kind, detail: None, all_durable, settle_s=0)
        try:
            await queues.start("q", [Entry(cell=c, argv=["true"]) for c in "ab"])
            await until("the queue to end", lambda: not queues.get("q").active, timeout=30)
            q = queues.get("q")
            assert [e.state for e in q.entries] == ["failed", "failed"]
            assert all(e.detail.startswith("could not start:") for e in q.entries), q.entries
            assert queues.waiting() == []  # nothing holds a release
            stopped = await queues.stop("q")  # and a stop of the ended queue answers
            assert not stopped.active
        finally:
            await queues.close()
            await sup.close()
            ledger.close()

    asyncio.run(main())
