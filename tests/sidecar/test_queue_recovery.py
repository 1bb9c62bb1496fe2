"""What a queue does with the entry a sidecar was starting when it died (the crash windows of "no cell
runs twice"), a restart that was due when it died, and the pure judgements (a cell's outcome, its
durability, the queue's result). The real QueueRunner and JobSupervisor on a real ledger, with real
processes."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable, Collection
from pathlib import Path

import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar import cellqueue, queuerecord
from sidecar.cellqueue import QueueRunner
from sidecar.errors import PreconditionError
from sidecar.identity import FileIdentity
from sidecar.jobrecord import JobRecord
from sidecar.jobs import JobSupervisor
from sidecar.ledger import ClaimRow, Ledger
from sidecar.queuerecord import CellEvidence, Entry, QueueRecord
from tests.sidecar.test_jobs import Events, until

MARK = "import sys; open(sys.argv[1], 'a').write('x')"  # one "x" per run
# Ignores SIGTERM, and ends once its gate file exists (a minute at most).
WAIT = (
    "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); d = time.monotonic() + 60\n"
    "while not os.path.exists(sys.argv[1]) and time.monotonic() < d: time.sleep(0.05)"
)

Body = Callable[[QueueRunner, JobSupervisor, Ledger], Awaitable[None]]


def job(job_id: str, **changes: object) -> JobRecord:
    """A finished job's record as a ledger holds it."""
    record = JobRecord(
        id=job_id,
        cell="a",
        argv=["x"],
        cwd="/",
        env={},
        pid=1,
        pgid=1,
        state="exited",
        exit_code=0,
        started_at_ns=1,
        ended_at_ns=2,
        log_path="/dev/null",
        proc_start_ticks=1,
    )
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


def runner_for(
    tmp_path: Path,
    body: Body,
    *,
    before: Callable[[Ledger], None] = lambda _: None,
    evidence: Callable[[Collection[str]], dict[str, CellEvidence]] | None = None,
    may_start: Callable[[], tuple[str, bool]] = lambda: ("", False),
) -> None:
    """Run `body` against a QueueRunner recovered from a ledger that `before` prepared (every
    finished cell durable unless `evidence` says otherwise)."""

    async def main() -> None:
        ledger = Ledger(tmp_path / "ledger.db")
        before(ledger)
        sup = JobSupervisor(ledger, tmp_path / "logs", tmp_path, Events())
        await sup.recover()
        queues = QueueRunner(
            ledger,
            sup,
            lambda kind, detail: None,
            evidence or (lambda cells: {c: CellEvidence(1, 1, 0) for c in cells}),
            may_start=may_start,
            settle_s=0,
        )
        try:
            await queues.recover()
            await body(queues, sup, ledger)
        finally:
            await queues.close()
            for j in sup.running():
                await sup.stop(j.id, grace_s=0)
            await sup.close()
            ledger.close()

    asyncio.run(main())


def marked(tmp_path: Path, cell: str) -> Entry:
    return Entry(cell=cell, argv=[sys.executable, "-c", MARK, str(tmp_path / f"{cell}.runs")])


def runs(tmp_path: Path, cell: str) -> int:
    path = tmp_path / f"{cell}.runs"
    return len(path.read_text()) if path.exists() else 0


def saved_queue(ledger: Ledger, entries: list[Entry]) -> None:
    ledger.save_queue("q", QueueRecord(name="q", entries=entries, created_at_ns=time.time_ns()).to_json())


async def over(queues: QueueRunner) -> QueueRecord:
    await until("the queue to end", lambda: not queues.get("q").active)
    return queues.get("q")


def test_a_cell_whose_start_never_began_is_started_after_a_restart(tmp_path: Path) -> None:
    a = dataclasses.replace(marked(tmp_path, "a"), state="starting", job_id="j00000001")

    async def body(queues: QueueRunner, sup: JobSupervisor, ledger: Ledger) -> None:
        q = await over(queues)
        assert [e.state for e in q.entries] == ["done"]
        assert q.entries[0].job_id != "j00000001"  # a fresh start, under a fresh id
        assert runs(tmp_path, "a") == 1

    runner_for(tmp_path, body, before=lambda ledger: saved_queue(ledger, [a]))


def test_a_cell_whose_start_may_have_run_is_failed_not_started_again(tmp_path: Path) -> None:
    a = dataclasses.replace(marked(tmp_path, "a"), state="starting", job_id="j00000002")

    def before(ledger: Ledger) -> None:
        saved_queue(ledger, [a, marked(tmp_path, "b")])
        (tmp_path / "logs").mkdir()
        (tmp_path / "logs" / "j00000002.log").write_text("")  # its keeper may have started it

    async def body(queues: QueueRunner, sup: JobSupervisor, ledger: Ledger) -> None:
        q = await over(queues)
        assert [e.state for e in q.entries] == ["failed", "done"]
        assert "whether it ran is unknown" in q.entries[0].detail
        assert runs(tmp_path, "a") == 0 and runs(tmp_path, "b") == 1
        # The next sidecar reads the same: nothing about it is left to decide.
        stored = QueueRecord.from_json(ledger.load_queues()[0])
        assert [e.state for e in stored.entries] == ["failed", "done"]

    runner_for(tmp_path, body, before=before)


def test_a_cell_whose_job_was_recorded_is_followed_to_its_end(tmp_path: Path) -> None:
    a = dataclasses.replace(marked(tmp_path, "a"), state="starting", job_id="j00000003")
    ended = job("j00000003", exit_code=-9)

    def before(ledger: Ledger) -> None:
        saved_queue(ledger, [a, marked(tmp_path, "b")])
        ledger.save_job(ended)

    async def body(queues: QueueRunner, sup: JobSupervisor, ledger: Ledger) -> None:
        q = await over(queues)
        assert [(e.state, e.detail, e.exit_code) for e in q.entries] == [
            ("failed", "killed by SIGKILL", -9),
            ("done", "", 0),
        ]
        assert runs(tmp_path, "a") == 0

    runner_for(tmp_path, body, before=before)


def test_a_restart_due_when_the_sidecar_stopped_is_armed_by_the_next_one(tmp_path: Path) -> None:
    marks = tmp_path / "again.runs"
    failed = job(
        "j00000004",
        argv=[sys.executable, "-c", MARK, str(marks)],
        cwd=str(tmp_path),
        exit_code=1,
        log_path=str(tmp_path / "logs" / "j00000004.log"),
        restart="on-failure",
        max_restarts=2,
        backoff_s=0.1,
        restart_at_ns=time.time_ns(),
    )
    stopped = dataclasses.replace(failed, id="j00000005", state="stopped", restart_at_ns=0, cell="b")

    def before(ledger: Ledger) -> None:
        ledger.save_job(failed)
        ledger.save_job(stopped)

    async def body(queues: QueueRunner, sup: JobSupervisor, ledger: Ledger) -> None:
        await until("the due restart", lambda: sup.get("j00000004").restarts == 1)
        await until("the restarted job to end", lambda: sup.settled("j00000004"))
        again = sup.get("j00000004")
        assert (again.state, again.exit_code, again.restart_at_ns) == ("exited", 0, 0)
        assert marks.read_text() == "x"
        assert sup.get("j00000005").restarts == 0  # nothing was due for it

    runner_for(tmp_path, body, before=before)


def test_the_outcome_of_a_cell_is_its_exit_status_and_state() -> None:
    base = job("j1")
    cases: list[tuple[dict[str, object], tuple[str, str]]] = [
        ({}, ("done", "")),
        ({"exit_code": 3}, ("failed", "exit 3")),
        ({"exit_code": -15}, ("failed", "killed by SIGTERM")),
        ({"state": "stopped", "exit_code": -15}, ("failed", "stopped")),
    ]
    for change, want in cases:
        assert queuerecord.outcome(dataclasses.replace(base, **change)) == want  # type: ignore[arg-type]
    # Lost: the sidecar was not its parent when it ended, so nobody knows how it ended: failed.
    state, why = queuerecord.outcome(dataclasses.replace(base, state="lost", exit_code=None))
    assert state == "failed" and why.startswith("lost")


def test_durability_and_result() -> None:
    now = 100 * 10**9
    ended = now - 5 * 10**9
    assert queuerecord.durability(CellEvidence(2, 2, 0), ended, now, 10) == pb.CELL_DURABLE
    assert queuerecord.durability(CellEvidence(2, 1, 0), ended, now, 10) == pb.CELL_PUSHING
    assert queuerecord.durability(CellEvidence(2, 2, 1), ended, now, 10) == pb.CELL_PUSHING
    # Nothing claimed: on its way until the settle time has passed, then NO_CHECKPOINT.
    assert queuerecord.durability(CellEvidence(0, 0, 0), ended, now, 10) == pb.CELL_PUSHING
    assert queuerecord.durability(CellEvidence(0, 0, 0), ended, now, 5) == pb.CELL_NO_CHECKPOINT
    assert queuerecord.durability(CellEvidence(0, 0, 1), ended, now, 1) == pb.CELL_PUSHING

    r = queuerecord.result
    assert r(["done", "pending"], [pb.CELL_DURABLE]) == pb.QUEUE_RUNNING
    assert r(["done", "running"], [pb.CELL_DURABLE]) == pb.QUEUE_RUNNING
    assert r(["done", "skipped"], [pb.CELL_DURABLE, pb.CELL_DURABLE]) == pb.QUEUE_OK
    assert r(["done", "done"], [pb.CELL_DURABLE, pb.CELL_PUSHING]) == pb.QUEUE_PUSHING
    assert r(["done", "done"], [pb.CELL_DURABLE, pb.CELL_NO_CHECKPOINT]) == pb.QUEUE_FAILED
    assert r(["done", "failed"], [pb.CELL_PUSHING]) == pb.QUEUE_FAILED
    assert r(["done", "cancelled"], [pb.CELL_DURABLE]) == pb.QUEUE_FAILED


def test_a_record_from_a_newer_version_still_loads() -> None:
    doc = QueueRecord(name="q", entries=[Entry(cell="a", argv=["x"])]).to_json()
    doc["future_field"] = 1
    doc["entries"][0]["another"] = "y"
    q = QueueRecord.from_json(doc)
    assert q.name == "q" and q.entries[0].cell == "a"


def claim(path: str, durable: bool) -> ClaimRow:
    return ClaimRow(
        id=1,
        path=path,
        size=1,
        blake3="0" * 64,
        identity=FileIdentity(1, 1, 1, 1, 1),
        sealed_at_ns=1,
        seq=1,
        durable=durable,
        durable_at_ns=0,
        push_error="",
    )


def test_evidence_counts_each_cells_claims_and_waiting_entries_in_one_pass() -> None:
    claims = [
        claim("a/ckpt-1.pt", True),
        claim("a/sub/ckpt-2.pt", False),
        claim("ab/ckpt-1.pt", True),  # another cell that begins like "a": not a's
        claim("b/ckpt-1.pt", True),
        claim("top.pt", True),  # right in the watched dir: no cell's
    ]
    got = queuerecord.evidence_of(
        ["a", "b", "c"], {"a/": "a", "b/": "b", "c/": "c"}, claims, ["a/ckpt-3.pt", "c"]
    )
    assert got == {"a": CellEvidence(2, 1, 1), "b": CellEvidence(1, 1, 0), "c": CellEvidence(0, 0, 0)}
    # Several watched dirs: each path begins with its dir's name, and a cell may have a dir in each.
    owner = {"w1/a/": "a", "w2/a/": "a", "w2/b/": "b"}
    claims = [
        claim("w1/a/x.pt", True),
        claim("w2/a/y.pt", True),
        claim("w1/b/z.pt", True),
        claim("a/q.pt", True),
    ]
    got = queuerecord.evidence_of(["a", "b"], owner, claims, [])
    assert got == {"a": CellEvidence(2, 2, 0), "b": CellEvidence(0, 0, 0)}


def test_a_release_checking_the_box_delays_a_cell_and_a_release_that_deleted_cancels_it(
    tmp_path: Path,
) -> None:
    checks = ["a release is checking", "a release is checking", ""]
    released = [False]

    def may_start() -> tuple[str, bool]:
        if released[0]:
            return "the box was released", True
        return (checks.pop(0) if checks else ""), False

    async def body(queues: QueueRunner, sup: JobSupervisor, ledger: Ledger) -> None:
        await queues.start("q", [marked(tmp_path, "a")])
        q = await over(queues)
        assert [e.state for e in q.entries] == ["done"] and not checks  # it waited, then ran
        released[0] = True
        await queues.start("q2", [marked(tmp_path, "b")])
        await until("q2 to end", lambda: not queues.get("q2").active)
        (b,) = queues.get("q2").entries
        assert (b.state, b.detail) == ("cancelled", "the box was released")
        assert runs(tmp_path, "a") == 1 and runs(tmp_path, "b") == 0

    runner_for(tmp_path, body, may_start=may_start)


def test_a_cell_that_finished_without_a_checkpoint_runs_again_in_the_next_pass(tmp_path: Path) -> None:
    claimed: dict[str, int] = {"a": 0}

    def evidence(cells: Collection[str]) -> dict[str, CellEvidence]:
        return {c: CellEvidence(claimed.get(c, 1), claimed.get(c, 1), 0) for c in cells}

    async def body(queues: QueueRunner, sup: JobSupervisor, ledger: Ledger) -> None:
        await queues.start("q", [marked(tmp_path, "a")])
        q = await over(queues)
        assert q.entries[0].state == "done"
        assert queues.to_pb(q).cells[0].durability == pb.CELL_NO_CHECKPOINT
        assert queues.to_pb(q).result == pb.QUEUE_FAILED
        _, began = await queues.start("q", [marked(tmp_path, "a")])  # fixed (say): it runs again
        assert began
        await until("the second run", lambda: runs(tmp_path, "a") == 2)
        claimed["a"] = 1  # this time it saved one
        q = await over(queues)
        assert q.entries[0].state == "done" and runs(tmp_path, "a") == 2
        _, began = await queues.start("q", [marked(tmp_path, "a")])  # finished, with a checkpoint
        q = await over(queues)
        assert q.entries[0].state == "skipped" and runs(tmp_path, "a") == 2

    runner_for(tmp_path, body, evidence=evidence)


def test_a_queue_being_stopped_is_not_silently_asked_again(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    waits = Entry(cell="a", argv=[sys.executable, "-c", WAIT, str(gate)])

    async def body(queues: QueueRunner, sup: JobSupervisor, ledger: Ledger) -> None:
        await queues.start("q", [waits])
        await until("a to run", lambda: bool(sup.running()))
        stopping = asyncio.ensure_future(queues.stop("q", grace_s=30))  # a SIGTERM it ignores
        await until("the stop to be recorded", lambda: queues.get("q").stopped)
        with pytest.raises(PreconditionError, match="is being stopped; ask again once it ended"):
            await queues.start("q", [waits])
        gate.touch()
        await stopping

    runner_for(tmp_path, body)


def test_the_oldest_ended_queues_are_forgotten_past_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cellqueue, "MAX_ENDED", 2)

    async def body(queues: QueueRunner, sup: JobSupervisor, ledger: Ledger) -> None:
        for name in ("q1", "q2", "q3"):
            await queues.start(name, [marked(tmp_path, name)])
            await until(f"{name} to end", lambda n=name: not queues.get(n).active)  # type: ignore[misc]
        assert [q.name for q in queues.queues()] == ["q3", "q2"]
        assert sorted(doc["name"] for doc in ledger.load_queues()) == ["q2", "q3"]

    runner_for(tmp_path, body)
