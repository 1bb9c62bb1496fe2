"""Cell queues on a real sidecar with real jobs: cells run one after another; a failed cell makes the
result FAILED; killing the sidecar mid-queue and starting it again continues at the right cell and
runs no cell twice; a re-run never runs a finished cell again; StopQueue stops the running cell and
cancels the rest."""

from __future__ import annotations

import contextlib
import itertools
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from tests.cellscript import cell_argv, runs
from tests.conftest import wait_until
from tests.sidecar.daemon import Daemon, running


def cell(d: Daemon, marks: Path, name: str, *flags: str, exit_code: int = 0) -> pb.QueueCell:
    argv = cell_argv(marks, d.watch, "{cell}", *flags)
    return pb.QueueCell(cell=name, argv=argv, env={"CELL_EXIT": str(exit_code)})


def queue(d: Daemon, name: str) -> pb.Queue:
    (q,) = d.stub.ListJobs(pb.ListJobsRequest(queues_only=True, queue=name), timeout=30).queues
    return q


def states(q: pb.Queue) -> dict[str, str]:
    return {c.spec.cell: pb.CellState.Name(c.state) for c in q.cells}


def settled(d: Daemon, name: str) -> pb.Queue:
    """The queue once nothing of it runs and its finished cells' evidence is settled."""
    return wait_until(
        lambda: (
            (q := queue(d, name)).result in (pb.QUEUE_OK, pb.QUEUE_FAILED)
            and all(c.durability != pb.CELL_PUSHING for c in q.cells)
            and q
        ),
        timeout=90,
        what=f"queue {name} to settle",
    )


@contextlib.contextmanager
def gates(marks: Path, *cells: str) -> Iterator[None]:
    """Open every gate at the end, whatever happened: no gated cell outlives the test."""
    try:
        yield
    finally:
        for c in cells:
            (marks / f"{c}.gate").touch()


def test_cells_run_in_order_and_a_failed_cell_fails_the_queue(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    with running(tmp_path / "box") as d:
        cells = [cell(d, marks, "a"), cell(d, marks, "b", exit_code=3), cell(d, marks, "c")]
        resp = d.stub.StartQueue(pb.StartQueueRequest(name="q1", cells=cells), timeout=30)
        assert resp.started and resp.queue.passes == 1
        q = settled(d, "q1")
        assert states(q) == {"a": "CELL_DONE", "b": "CELL_FAILED", "c": "CELL_DONE"}
        assert q.result == pb.QUEUE_FAILED
        b = q.cells[1]
        assert b.exit_code == 3 and b.detail == "exit 3"
        for c in (q.cells[0], q.cells[2]):
            assert c.durability == pb.CELL_DURABLE and c.claims == c.durable_claims == 1
        # One after another: each cell's job started after the one before had ended.
        jobs = {j.id: j for j in d.stub.ListJobs(pb.ListJobsRequest(), timeout=30).jobs}
        ordered = [jobs[c.job_id] for c in q.cells]
        for before, after in itertools.pairwise(ordered):
            assert after.started_at_unix_ns >= before.ended_at_unix_ns > 0
        assert [len(runs(marks, c)) for c in "abc"] == [1, 1, 1]
        assert runs(marks, "a")[0].endswith(" a")  # "{cell}" was filled in
        # Only asked for: a plain ListJobs (the gate's) carries no queue; a brief one no commands.
        assert not d.stub.ListJobs(pb.ListJobsRequest(), timeout=30).queues
        (brief,) = d.stub.ListJobs(pb.ListJobsRequest(queues_only=True, brief=True), timeout=30).queues
        assert [(c.spec.cell, list(c.spec.argv)) for c in brief.cells] == [("a", []), ("b", []), ("c", [])]
        assert brief.result == pb.QUEUE_FAILED
        assert not d.stub.ListJobs(pb.ListJobsRequest(queues_only=True, queue="nope"), timeout=30).queues
        finished = [e for e in d.events() if pb.EventKind.Name(e.kind) == "QUEUE_FINISHED"]
        assert len(finished) == 1 and "b (exit 3)" in finished[0].detail


def test_a_killed_sidecar_continues_its_queue_at_the_right_cell_and_runs_no_cell_twice(
    tmp_path: Path,
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    with running(tmp_path / "box") as d, gates(marks, "c", "d"):
        cells = [
            cell(d, marks, "a"),
            cell(d, marks, "b", exit_code=2),
            cell(d, marks, "c", "--gate"),
            cell(d, marks, "d", "--gate"),
            cell(d, marks, "e"),
        ]
        d.stub.StartQueue(pb.StartQueueRequest(name="q2", cells=cells), timeout=30)
        wait_until(lambda: runs(marks, "c"), what="cell c to start")
        c_job = queue(d, "q2").cells[2].job_id

        # 1. Killed while c runs; c ends while no sidecar runs.
        d.kill(signal.SIGKILL)
        (marks / "c.gate").touch()
        wait_until(lambda: (marks / "c.end").exists(), what="cell c to end with no sidecar")
        d.start()
        wait_until(lambda: runs(marks, "d"), what="cell d to start after the restart")
        q = queue(d, "q2")
        assert q.cells[2].job_id == c_job and states(q)["c"] == "CELL_DONE"
        assert states(q)["d"] == "CELL_RUNNING" and states(q)["e"] == "CELL_PENDING"

        # 2. Killed while d runs; d still runs when the sidecar is back: followed, not started again.
        d_job = q.cells[3].job_id
        d.kill(signal.SIGKILL)
        d.start()
        q = queue(d, "q2")
        assert states(q)["d"] == "CELL_RUNNING" and q.cells[3].job_id == d_job
        assert states(q)["e"] == "CELL_PENDING"
        (marks / "d.gate").touch()

        q = settled(d, "q2")
        assert states(q) == {
            "a": "CELL_DONE",
            "b": "CELL_FAILED",
            "c": "CELL_DONE",
            "d": "CELL_DONE",
            "e": "CELL_DONE",
        }
        assert q.result == pb.QUEUE_FAILED and q.cells[1].detail == "exit 2"
        assert [len(runs(marks, c)) for c in "abcde"] == [1, 1, 1, 1, 1]


def test_a_rerun_queues_only_the_cells_that_did_not_finish(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    with running(tmp_path / "box") as d:
        flaky = cell(d, marks, "b", exit_code=4)
        cells = [cell(d, marks, "a"), flaky]
        d.stub.StartQueue(pb.StartQueueRequest(name="q3", cells=cells), timeout=30)
        assert settled(d, "q3").result == pb.QUEUE_FAILED

        # The same queue asked again while it runs changes nothing; once over, a new pass: a is
        # not run again, b is (fixed now).
        fixed = [cell(d, marks, "a"), cell(d, marks, "b")]
        again = d.stub.StartQueue(pb.StartQueueRequest(name="q3", cells=fixed), timeout=30)
        assert again.started and again.queue.passes == 2
        q = settled(d, "q3")
        assert states(q) == {"a": "CELL_SKIPPED", "b": "CELL_DONE"}
        assert q.result == pb.QUEUE_OK
        assert q.cells[0].durability == pb.CELL_DURABLE and "finished on this box before" in q.cells[0].detail
        assert [len(runs(marks, c)) for c in "ab"] == [1, 2]

        # A cell finished on this box is never run by another queue either.
        other = d.stub.StartQueue(pb.StartQueueRequest(name="q4", cells=[cell(d, marks, "a")]), timeout=30)
        assert other.started
        assert states(settled(d, "q4")) == {"a": "CELL_SKIPPED"}
        assert len(runs(marks, "a")) == 1


def test_a_running_queue_asked_again_is_left_alone_and_other_cells_under_its_name_are_refused(
    tmp_path: Path,
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    with running(tmp_path / "box") as d, gates(marks, "a"):
        cells = [cell(d, marks, "a", "--gate"), cell(d, marks, "b")]
        d.stub.StartQueue(pb.StartQueueRequest(name="q5", cells=cells), timeout=30)
        wait_until(lambda: runs(marks, "a"))
        same = d.stub.StartQueue(pb.StartQueueRequest(name="q5", cells=cells), timeout=30)
        assert not same.started
        with pytest.raises(grpc.RpcError) as err:
            d.stub.StartQueue(pb.StartQueueRequest(name="q5", cells=cells[:1]), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "running with other cells" in str(err.value.details())
        # Another queue may not run a cell this one still has to run.
        with pytest.raises(grpc.RpcError) as err:
            d.stub.StartQueue(pb.StartQueueRequest(name="q6", cells=cells[1:]), timeout=30)
        assert "queued in running queue 'q5'" in str(err.value.details())
        (marks / "a.gate").touch()
        assert settled(d, "q5").result == pb.QUEUE_OK
        assert len(runs(marks, "a")) == 1


def test_stopping_a_queue_stops_its_running_cell_and_cancels_the_rest(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    with running(tmp_path / "box") as d, gates(marks, "a"):
        cells = [cell(d, marks, "a", "--gate"), cell(d, marks, "b")]
        d.stub.StartQueue(pb.StartQueueRequest(name="q7", cells=cells), timeout=30)
        wait_until(lambda: runs(marks, "a"))
        stopped = d.stub.StopQueue(pb.StopQueueRequest(name="q7", grace_s=1), timeout=60).queue
        assert stopped.stopped
        q = settled(d, "q7")
        assert states(q) == {"a": "CELL_FAILED", "b": "CELL_CANCELLED"}
        assert q.cells[0].detail == "stopped" and q.result == pb.QUEUE_FAILED and q.ended_at_unix_ns
        assert not runs(marks, "b")
        with pytest.raises(grpc.RpcError) as err:
            d.stub.StopQueue(pb.StopQueueRequest(name="nope"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_queue_with_a_cell_that_cannot_start_goes_on_and_fails(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    with running(tmp_path / "box") as d:
        missing = pb.QueueCell(cell="x", argv=["/nonexistent/trainer"])
        cells = [missing, cell(d, marks, "y")]
        d.stub.StartQueue(pb.StartQueueRequest(name="q8", cells=cells), timeout=30)
        q = settled(d, "q8")
        assert states(q) == {"x": "CELL_FAILED", "y": "CELL_DONE"}
        assert q.cells[0].detail.startswith("could not start:") and q.result == pb.QUEUE_FAILED


BAD = [
    ("ok", [], "has no cells"),
    ("../q", [pb.QueueCell(cell="a", argv=["true"])], "queue name '../q' is not allowed"),
    ("ok", [pb.QueueCell(cell="../x", argv=["true"])], "cell '../x' is not allowed"),
    (
        "ok",
        [pb.QueueCell(cell="a", argv=["true"]), pb.QueueCell(cell="a", argv=["true"])],
        "names cell 'a' twice",
    ),
    ("ok", [pb.QueueCell(cell="a")], "has no program"),
    ("ok", [pb.QueueCell(cell="a", argv=["true"], cwd="rel")], "must be an absolute path"),
]


def test_a_bad_queue_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with running(tmp_path / "box") as d:
        for name, cells, message in BAD:
            with pytest.raises(grpc.RpcError) as err:
                d.stub.StartQueue(pb.StartQueueRequest(name=name, cells=cells), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert message in str(err.value.details())
        with pytest.raises(grpc.RpcError) as err:
            d.stub.StartQueue(pb.StartQueueRequest(name="ok", cells=BAD[1][1], restart="always"), timeout=30)
        assert "restart policy 'always'" in str(err.value.details())
        assert not d.stub.ListJobs(pb.ListJobsRequest(queues_only=True), timeout=30).queues
        assert not d.stub.ListJobs(pb.ListJobsRequest(), timeout=30).jobs


def test_a_release_is_refused_while_a_queue_has_cells_to_run(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    with running(tmp_path / "box") as d, gates(marks, "a"):
        cells = [cell(d, marks, "a", "--gate"), cell(d, marks, "b")]
        d.stub.StartQueue(pb.StartQueueRequest(name="q9", cells=cells), timeout=30)
        wait_until(lambda: runs(marks, "a"))
        r = d.stub.ReleaseArtifacts(pb.ReleaseArtifactsRequest(manifest_digest="0" * 64), timeout=30)
        held = [x.detail for x in r.refused if x.code == "JOB_RUNNING"]
        assert "queue q9 (1 cells to run: b)" in held and not r.deleted
        d.stub.StopQueue(pb.StopQueueRequest(name="q9", grace_s=1), timeout=60)
        settled(d, "q9")
        r = d.stub.ReleaseArtifacts(pb.ReleaseArtifactsRequest(manifest_digest="0" * 64), timeout=30)
        assert not [x for x in r.refused if x.code == "JOB_RUNNING"]


def test_a_job_of_a_cell_that_runs_or_is_queued_is_refused(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    with running(tmp_path / "box") as d, gates(marks, "a", "b"):
        cells = [cell(d, marks, "a", "--gate"), cell(d, marks, "b", "--gate")]
        d.stub.StartQueue(pb.StartQueueRequest(name="q10", cells=cells), timeout=30)
        wait_until(lambda: runs(marks, "a"))
        for name, why in (
            ("a", "cell a already runs as job"),
            ("b", "cell b is queued in running queue 'q10'"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                d.stub.StartJob(pb.StartJobRequest(argv=["true"], cell=name), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert why in str(err.value.details())
        (marks / "a.gate").touch()
        (marks / "b.gate").touch()
        settled(d, "q10")
        done = d.stub.StartJob(pb.StartJobRequest(argv=["true"], cell="b"), timeout=30).job
        assert done.cell == "b"  # by hand, once nothing else runs it
        assert [len(runs(marks, c)) for c in "ab"] == [1, 1]
