"""What `watch` says of a box and its cells, from a status row and a queue (pure)."""

from __future__ import annotations

import os
import subprocess
import time

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import armed
from controller.armed import process_start
from controller.state import Box
from controller.watchview import Seen, cell_text, idle_for, lacks


def seen(row: dict[str, object], cells: list[pb.QueuedCell] | None = None) -> Seen:
    box = Box(name="b", profile="local", box_dir="/x", state_dir="/x/s", socket="/x/s.sock", workdir="/x",
              watch=("/x/w",), durable="file:///d", run_id="r")  # fmt: skip
    return Seen(box, row={"status": "up", **row}, queue=pb.Queue(cells=cells) if cells is not None else None)


def cell(name: str, state: int, job: str = "", detail: str = "") -> pb.QueuedCell:
    return pb.QueuedCell(spec=pb.QueueCell(cell=name), state=state, job_id=job, detail=detail)  # type: ignore[arg-type]


def test_a_cell_shows_its_jobs_step_and_loss_or_that_it_stalled_or_why_it_failed() -> None:
    row = {
        "progress": [
            {"job_id": "j1", "step": 120, "loss": 0.5, "nonfinite": 0},
            {"job_id": "j2", "step": 3, "loss": None, "nonfinite": 2},
        ],
        "alerts": [{"kind": "JOB_STALLED", "subject": "j3", "detail": "", "since_unix_ns": 1}],
    }
    s = seen(row)
    assert cell_text(s, cell("a", pb.CELL_RUNNING, "j1")) == "running 120 0.5"
    assert cell_text(s, cell("b", pb.CELL_RUNNING, "j2")) == "running 3 nan"
    assert cell_text(s, cell("c", pb.CELL_RUNNING, "j3")) == "stalled"
    assert cell_text(s, cell("d", pb.CELL_FAILED, "j4", "exit 3")) == "failed exit 3"
    assert cell_text(s, cell("e", pb.CELL_PENDING)) == "pending"


def test_what_a_box_lacks_and_when_it_is_idle() -> None:
    busy = seen(
        {"jobs_running": 1, "claims": 3, "durable": 2},
        [cell("a", pb.CELL_RUNNING), cell("b", pb.CELL_PENDING)],
    )
    assert lacks(busy) == ["1 job", "2 cells", "1 not durable"]
    assert idle_for(busy) is None
    ended = time.time_ns() - 90 * 10**9
    done = seen(
        {"jobs_running": 0, "claims": 2, "durable": 2, "jobs_ended_unix_ns": ended}, [cell("a", pb.CELL_DONE)]
    )
    assert lacks(done) == ["pull+verify"]
    idle = idle_for(done)
    assert idle is not None and 89 < idle < 120
    assert lacks(seen({"unreachable": True})) == ["an answer"]


def test_a_box_is_armed_only_while_the_very_process_recorded_follows_it() -> None:
    s = seen({"jobs_running": 1})
    me = os.getpid()
    s.box = s.box.with_(armed_pid=me, armed_start=process_start(me))
    assert armed.follower(s.box) == me and lacks(s) == ["armed: 1 job"]
    s.box = s.box.with_(armed_start=process_start(me) + "0")  # the pid is another process now
    assert armed.follower(s.box) == 0 and lacks(s) == ["1 job"]
    s.box = s.box.with_(armed_start="")  # recorded without its start time: proves nothing
    assert armed.follower(s.box) == 0
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert (
        process_start(gone.pid) == ""
        and armed.follower(s.box.with_(armed_pid=gone.pid, armed_start="x:1")) == 0
    )
