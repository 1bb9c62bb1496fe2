"""What `fanout up` does to each box, decided before anything starts (controller.fanoutplan): cells
matched by name, never by position; a finished cell never runs again unasked, wherever and in
whichever run of a box it finished, and only a cell its queue said done finished; a torn-down box
stays down unless asked; a cell still on another box's queue moves only once that queue let it go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.cellfacts import Fact
from controller.errors import UsageError
from controller.fanoutplan import DOWN, NEW, RESTART, UP, Seen, Settled, settle
from controller.plan import Plan, parse_plan, plan_json

BOXES = '[[box]]\nname = "f1"\nprofile = "local"\n\n[[box]]\nname = "f2"\nprofile = "local"\n\n'
SPREAD = '[[cell]]\nname = "c1"\n\n[[cell]]\nname = "c2"\n\n[[cell]]\nname = "c3"\n'


def plan_of(cells: str) -> Plan:
    text = f'name = "sweep"\n[defaults]\ncommand = ["true"]\n\n{BOXES}{cells}'
    return parse_plan(text, file="plan.toml", default_name="plan", base=Path("/"), known_profiles=("local",))


def applied(plan: Plan) -> dict[str, Any]:
    """The record of `plan` applied first (each box's cells as the plan spreads them)."""
    return plan_json(plan)


def by_box(s: Settled) -> dict[str, tuple[str, list[str], list[str]]]:
    return {
        bp.box.name: (bp.action, [c.name for c in bp.cells], [c.name for c in bp.queue]) for bp in s.boxes
    }


RUNS = {"f1": "run-1", "f2": "run-2"}
UP_BOTH = Seen({"f1": "up", "f2": "up"}, RUNS)


def done(box: str, cell: str, run: str = "", **kw: Any) -> Fact:
    """What a box's queue said of a cell that finished (in the box's current run by default)."""
    return Fact(box, run or RUNS[box], cell, "done", "durable", job_id="j-1", **kw)


def seen(status: dict[str, str] | None = None, *facts: Fact, **kw: Any) -> Seen:
    by_cell: dict[str, list[Fact]] = {}
    for f in facts:
        by_cell.setdefault(f.cell, []).append(f)
    return Seen(status or {"f1": "up", "f2": "up"}, RUNS, by_cell, **kw)


def test_a_pinned_cell_added_at_the_top_moves_no_other_cell() -> None:
    first = plan_of(SPREAD)
    assert {b: [c.name for c in cs] for b, cs in first.assignment().items()} == {
        "f1": ["c1", "c3"],
        "f2": ["c2"],
    }
    s = settle(plan_of('[[cell]]\nname = "c0"\nbox = "f1"\n\n' + SPREAD), applied(first), UP_BOTH)
    assert by_box(s) == {"f1": (UP, ["c0", "c1", "c3"], ["c0", "c1", "c3"]), "f2": (UP, ["c2"], ["c2"])}
    assert s.notes == []


def test_new_cells_are_spread_over_the_boxes_that_will_run_only() -> None:
    first = plan_of(SPREAD)
    seen = Seen({"f1": "up", "f2": "down"})
    s = settle(plan_of(SPREAD + '\n[[cell]]\nname = "c4"\n\n[[cell]]\nname = "c5"\n'), applied(first), seen)
    assert by_box(s)["f1"] == (UP, ["c1", "c3", "c4", "c5"], ["c1", "c3", "c4", "c5"])
    assert by_box(s)["f2"] == (DOWN, ["c2"], [])


def test_a_torn_down_box_stays_down_and_only_what_its_queue_said_done_finished() -> None:
    first = plan_of(SPREAD)
    down = {"f1": "up", "f2": "down"}
    s = settle(first, applied(first), seen(down, done("f2", "c2")))
    assert by_box(s)["f2"] == (DOWN, ["c2"], [])
    assert s.notes == [
        "box f2: torn down, not started again (`fanout up --restart-box f2` starts it); its cells c2 finished"
    ]
    with pytest.raises(UsageError, match="--restart-box f2: nothing would run on it"):
        settle(first, applied(first), seen(down, done("f2", "c2")), restart=["f2"])
    with pytest.raises(UsageError, match="--rerun c2: its box f2 is torn down; add --restart-box f2"):
        settle(first, applied(first), seen(down, done("f2", "c2")), rerun=["c2"])
    again = settle(first, applied(first), seen(down, done("f2", "c2")), restart=["f2"], rerun=["c2"])
    assert by_box(again)["f2"] == (RESTART, ["c2"], ["c2"])
    assert "box f2: torn down, started again (--restart-box) for c2" in again.notes
    # Stopped mid-run, or never seen: not finished, and said so.
    stopped = Fact("f2", "run-2", "c2", "failed", detail="stopped", job_id="j-2", queue="sweep")
    s = settle(first, applied(first), seen(down, stopped))
    assert s.notes == [
        "box f2: torn down, not started again (`fanout up --restart-box f2` starts it); cells c2 did not "
        "finish and wait for it (c2: failed: stopped (job j-2))"
    ]
    assert "c2: never seen in its queue here" in settle(first, applied(first), seen(down)).notes[0]
    assert by_box(settle(first, applied(first), seen(down, stopped), restart=["f2"]))["f2"] == (
        RESTART,
        ["c2"],
        ["c2"],
    )
    # Moved to a box that runs: it runs there, and the notes say how it ended on f2.
    moved = plan_of(SPREAD.replace('name = "c2"\n', 'name = "c2"\nbox = "f1"\n'))
    s = settle(moved, applied(first), seen(down, stopped))
    assert by_box(s)["f1"] == (UP, ["c1", "c2", "c3"], ["c1", "c2", "c3"])
    assert "cell c2: runs on f1; it did not finish on f2: failed: stopped (job j-2)" in s.notes


def test_a_box_started_again_does_not_run_what_finished_in_its_earlier_run() -> None:
    first = plan_of(SPREAD)
    earlier = done("f2", "c2", run="run-0")  # learnt before f2 was torn down and started again (run-2)
    s = settle(plan_of(SPREAD + '\n[[cell]]\nname = "c4"\nbox = "f2"\n'), applied(first), seen(None, earlier))
    assert by_box(s)["f2"] == (UP, ["c2", "c4"], ["c4"])
    assert s.notes == [
        "cell c2: not run on f2: it finished on f2 in an earlier run (run-0): done (job j-1), its "
        "checkpoints durable (`--rerun c2` runs it again)"
    ]
    asked = settle(first, applied(first), seen(None, earlier), rerun=["c2"])
    assert by_box(asked)["f2"] == (UP, ["c2"], ["c2"])


def test_a_renamed_plan_finds_what_the_boxes_finished_under_the_old_name() -> None:
    finished = [done("f1", "c1"), done("f2", "c2"), done("f1", "c3")]
    renamed = plan_of('[[cell]]\nname = "c0"\nbox = "f1"\n\n' + SPREAD)  # no record of it here
    s = settle(renamed, None, seen(None, *finished))
    assert by_box(s) == {"f1": (UP, ["c0", "c1", "c3"], ["c0"]), "f2": (UP, ["c2"], [])}
    assert "cell c1: not run on f1: it finished on f1: done (job j-1), its checkpoints durable" in s.notes[0]


def test_a_finished_cell_pinned_to_another_box_is_not_run_there_unless_asked() -> None:
    first = plan_of(SPREAD)
    moved = plan_of(SPREAD.replace('name = "c1"\n', 'name = "c1"\nbox = "f2"\n'))
    s = settle(moved, applied(first), seen(None, done("f1", "c1")))
    assert by_box(s)["f2"] == (UP, ["c1", "c2"], ["c2"])
    assert (
        "cell c1: not run on f2: it finished on f1: done (job j-1), its checkpoints durable "
        "(`--rerun c1` runs it again)" in s.notes
    )
    asked = settle(moved, applied(first), seen(None, done("f1", "c1")), rerun=["c1"])
    assert by_box(asked)["f2"] == (UP, ["c1", "c2"], ["c1", "c2"])
    assert "cell c1: runs again on f2 (--rerun)" in asked.notes


def test_a_cell_finished_on_its_own_box_is_held_and_a_rerun_there_says_how() -> None:
    first = plan_of(SPREAD)
    s = settle(first, applied(first), seen(None, done("f1", "c1")))
    assert by_box(s)["f1"] == (UP, ["c1", "c3"], ["c3"])  # never asked of a queue that ended
    assert s.boxes[0].queued == ["c3"] and s.boxes[0].held["c1"].startswith("it finished on f1")
    # Its queue still runs (c3): the list it runs with stays the same, c1 held all the same.
    busy = seen(None, done("f1", "c1"), busy={"f1": {"c3": "sweep"}}, active={"f1"})
    s = settle(first, applied(first), busy)
    assert by_box(s)["f1"] == (UP, ["c1", "c3"], ["c1", "c3"]) and s.boxes[0].queued == ["c3"]
    # Its command changed: held, and said so (a box's queue would skip it silently).
    changed = done("f1", "c1", spec={"argv": ["false"], "cwd": "", "env": {}})
    s = settle(first, applied(first), seen(None, changed))
    assert "the plan gives it another command (argv, cwd or env) now" in s.boxes[0].held["c1"]
    assert "`boxwarden run f1 --cell c1 -- CMD ...` by hand, or give it another box" in s.notes[0]
    with pytest.raises(
        UsageError, match=r"--rerun c1: c1 finished on f1 .*which is up.*boxwarden run f1 --cell c1"
    ):
        settle(first, applied(first), seen(None, changed), rerun=["c1"])


def test_a_cell_still_on_another_boxs_queue_moves_only_once_that_queue_let_it_go() -> None:
    first = plan_of(SPREAD)
    moved = plan_of(SPREAD.replace('name = "c3"\n', 'name = "c3"\nbox = "f2"\n'))
    s = settle(moved, applied(first), seen(busy={"f1": {"c3": "sweep"}}))
    f2 = s.boxes[1]
    assert [c.name for c in f2.queue] == ["c2"] and f2.moving == {"c3"}
    assert [c["name"] for c in f2.recorded()["cells"]] == ["c2"]  # not its own yet: shown again next time
    assert "once that queue ended or was stopped (`boxwarden queue f1 sweep --stop`)" in f2.held["c3"]
    asked = settle(moved, applied(first), seen(busy={"f1": {"c3": "sweep"}}), rerun=["c3"])
    assert [c.name for c in asked.boxes[1].queue] == ["c2"]  # asked or not: never on two queues at once
    silent = settle(moved, applied(first), seen(silent={"f1": "no answer"}))
    assert "whose queue cannot be read (no answer)" in silent.boxes[1].held["c3"]
    free = settle(moved, applied(first), UP_BOTH)
    assert [c.name for c in free.boxes[1].queue] == ["c2", "c3"]


def test_what_cannot_be_met_is_refused_before_anything_starts() -> None:
    first = plan_of(SPREAD)
    with pytest.raises(UsageError, match="--rerun c9: no \\[\\[cell\\]\\] of plan sweep"):
        settle(first, applied(first), UP_BOTH, rerun=["c9"])
    with pytest.raises(UsageError, match="--restart-box f1: f1 is up, not torn down"):
        settle(first, applied(first), UP_BOTH, restart=["f1"])
    with pytest.raises(UsageError, match="--restart-box f1: f1 is new, not torn down"):
        settle(first, None, Seen({}), restart=["f1"])
    with pytest.raises(UsageError, match="cells c4 are new and every box of plan sweep is torn down"):
        settle(
            plan_of(SPREAD + '\n[[cell]]\nname = "c4"\n'), applied(first), Seen({"f1": "down", "f2": "down"})
        )
    assert [bp.action for bp in settle(first, None, Seen({})).boxes] == [NEW, NEW]


def test_a_cell_done_with_nothing_claimed_yet_is_not_finished(tmp_path: Path) -> None:
    """Second review of issue 25: a queue read in the seconds after a cell's job ended with nothing
    claimed said PUSHING, and the cell was kept finished for good, though its queue said
    NO_CHECKPOINT once those seconds passed."""
    from boxwarden_pb.v1 import sidecar_pb2 as pb

    from controller import cellfacts
    from controller.state import Box, State

    def listing(durability: int, claims: int) -> pb.Queue:
        cell = pb.QueuedCell(spec=pb.QueueCell(cell="a"), state=pb.CELL_DONE, job_id="j1", exit_code=0,
                             durability=durability, claims=claims)  # fmt: skip
        return pb.Queue(name="p", cells=[cell])

    state = State(tmp_path / "home")
    box = Box(name="g1", profile="local", box_dir="", state_dir="", socket="", workdir="", watch=(),
              durable="", run_id="r1")  # fmt: skip
    try:
        cellfacts.learn(state, box, [listing(pb.CELL_PUSHING, 0)])
        (fact,) = cellfacts.facts(state, ["a"])["a"]
        assert not fact.finished and "nothing claimed yet" in fact.describe()
        cellfacts.learn(state, box, [listing(pb.CELL_NO_CHECKPOINT, 0)])
        (fact,) = cellfacts.facts(state, ["a"])["a"]
        assert not fact.finished and "left no checkpoint" in fact.describe()
        cellfacts.learn(state, box, [listing(pb.CELL_PUSHING, 2)])  # a cell that did save: finished
        (fact,) = cellfacts.facts(state, ["a"])["a"]
        assert fact.finished
    finally:
        state.close()
