"""`fanout up PLAN` through the real CLI with real local boxes: every box comes up, each gets its
cells as a queue, a second run changes nothing and runs no cell again (nor one whose command changed:
it is held, saying why), a changed plan is shown and applied only when confirmed, and two boxes that
would watch one directory are refused. A plan is applied by identity: a cell added at the top moves
no other cell, a plan copied under another name runs nothing that finished, a box torn down stays
down unless asked and what it finished never runs again (not even once it is brought up again by
hand) while what it did not finish is said and runs where the plan moves it, and a change that
failed is shown again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cellscript import cell_argv, runs
from tests.conftest import Bw, wait_until
from tests.controller.test_meter_stop import fake_profile, provider


def write_plan(path: Path, marks: Path, cells: str, boxes: str = "", *flags: str) -> Path:
    argv = cell_argv(marks, Path("ckpt"), *flags)  # relative: each box's own watched dir (its workdir/ckpt)
    path.write_text(
        f'name = "sweep"\n[defaults]\ncommand = {json.dumps(argv)}\n\n'
        + (boxes or '[[box]]\nname = "f1"\nprofile = "local"\n\n[[box]]\nname = "f2"\nprofile = "local"\n\n')
        + cells
    )
    return path


def wait_queues(bw: Bw, *names: str) -> None:
    for box in names:
        r = bw("queue", box, "sweep", "--wait", "--timeout", "90", "--json", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr  # every cell finished, its checkpoints durable


@pytest.fixture
def marks(tmp_path: Path) -> Path:
    """Where the cells count their runs (tests.cellscript)."""
    (tmp_path / "marks").mkdir()
    return tmp_path / "marks"


CELLS = '[[cell]]\nname = "a"\nbox = "f1"\n\n[[cell]]\nname = "b"\n\n[[cell]]\nname = "c"\n'


def test_fanout_up_spreads_the_cells_and_a_second_run_changes_nothing(
    bw: Bw, tmp_path: Path, marks: Path
) -> None:
    plan = write_plan(tmp_path / "sweep.toml", marks, CELLS)
    doc = bw.json("fanout", "up", str(plan))
    got = {b["box"]: (b["up"], b["queue"], b["cells"], b["error"]) for b in doc["boxes"]}
    assert got == {"f1": ("started", "queued", ["a", "c"], ""), "f2": ("started", "queued", ["b"], "")}
    wait_queues(bw, "f1", "f2")
    assert [len(runs(marks, c)) for c in "abc"] == [1, 1, 1]
    # Each box watched its own directory, and holds its own cells' checkpoints.
    assert sorted(p.name for p in (tmp_path / "f1" / "ckpt").iterdir()) == ["a", "c"]
    assert sorted(p.name for p in (tmp_path / "f2" / "ckpt").iterdir()) == ["b"]

    again = bw.json("fanout", "up", str(plan))
    got = {b["box"]: (b["up"], b["queue"], b["queued"], sorted(b["held"])) for b in again["boxes"]}
    assert got == {"f1": ("running", "none", [], ["a", "c"]), "f2": ("running", "none", [], ["b"])}
    assert again["boxes"][1]["held"]["b"].startswith("it finished on f2: done (job ")
    for box in ("f1", "f2"):  # the queues were left as they ended
        assert {c["state"] for c in bw.json("queue", box, "sweep")["cells"]} == {"done"}
    # b's command changes: held, saying why; never reported queued, then skipped by its box's queue.
    write_plan(plan, marks, CELLS.replace('name = "b"\n', 'name = "b"\nenv = { LR = "3e-4" }\n'))
    r = bw("fanout", "up", str(plan), "--yes", "--json")
    f2 = json.loads(r.stdout)["boxes"][1]
    assert (f2["queue"], f2["queued"]) == ("none", []), r.stderr
    assert "the plan gives it another command (argv, cwd or env) now" in f2["held"]["b"]
    assert "cell b: not run on f2: it finished on f2" in r.stderr and "boxwarden run f2 --cell b" in r.stderr
    r = bw("fanout", "up", str(plan), "--yes", "--rerun", "b")  # its box's queue cannot: said how instead
    assert r.returncode == 2 and "--rerun b: b finished on f2" in r.stderr and "protocol" in r.stderr
    assert [len(runs(marks, c)) for c in "abc"] == [1, 1, 1]  # no cell ran again


def test_a_changed_plan_is_shown_and_applied_only_when_confirmed(bw: Bw, tmp_path: Path, marks: Path) -> None:
    plan = write_plan(tmp_path / "sweep.toml", marks, CELLS)
    bw.ok("fanout", "up", str(plan))
    write_plan(plan, marks, CELLS + '\n[[cell]]\nname = "d"\n')
    r = bw("fanout", "up", str(plan))  # stdin is no terminal: refused, with the difference shown
    assert r.returncode == 2, r.stderr
    assert "box f2: cell d added" in r.stderr and "--yes" in r.stderr and "nothing was changed" in r.stderr
    for box in ("f1", "f2"):
        bw("queue", box, "sweep", "--wait", "--timeout", "90", timeout=120)
    assert not runs(marks, "d")
    doc = bw.json("fanout", "up", str(plan), "--yes")
    assert {b["box"]: b["cells"] for b in doc["boxes"]} == {"f1": ["a", "c"], "f2": ["b", "d"]}
    r = bw("queue", "f2", "sweep", "--wait", "--timeout", "90", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    assert [len(runs(marks, c)) for c in "abcd"] == [1, 1, 1, 1]


PINNED = '[[cell]]\nname = "c0"\nbox = "f1"\n\n'
SPREAD = '[[cell]]\nname = "c1"\n\n[[cell]]\nname = "c2"\n\n[[cell]]\nname = "c3"\n'


def test_a_cell_added_at_the_top_moves_no_other_cell(bw: Bw, tmp_path: Path, marks: Path) -> None:
    plan = write_plan(tmp_path / "sweep.toml", marks, SPREAD)
    doc = bw.json("fanout", "up", str(plan))
    assert {b["box"]: b["cells"] for b in doc["boxes"]} == {"f1": ["c1", "c3"], "f2": ["c2"]}
    wait_queues(bw, "f1", "f2")
    # A pinned cell at the top: by position, c1 and c2 would change boxes and train again there.
    write_plan(plan, marks, PINNED + SPREAD)
    doc = bw.json("fanout", "up", str(plan), "--yes")
    assert {b["box"]: b["cells"] for b in doc["boxes"]} == {"f1": ["c0", "c1", "c3"], "f2": ["c2"]}
    wait_queues(bw, "f1", "f2")
    assert [len(runs(marks, c)) for c in ("c0", "c1", "c2", "c3")] == [1, 1, 1, 1]
    # The plan copied under a new name (its default name is the file's): the boxes' finished cells
    # are theirs whatever the plan's name, and stay where they finished; only the new cell runs.
    copy = tmp_path / "sweep-v2.toml"
    copy.write_text(plan.read_text().replace('name = "sweep"\n', "") + '\n[[cell]]\nname = "c4"\n')
    doc = bw.json("fanout", "up", str(copy))
    got = {b["box"]: (b["cells"], b["queued"], sorted(b["held"])) for b in doc["boxes"]}
    assert got == {"f1": (["c0", "c1", "c3"], [], ["c0", "c1", "c3"]), "f2": (["c2", "c4"], ["c4"], ["c2"])}
    assert bw("queue", "f2", "sweep-v2", "--wait", "--timeout", "90", timeout=120).returncode == 0
    assert [len(runs(marks, c)) for c in ("c0", "c1", "c2", "c3", "c4")] == [1, 1, 1, 1, 1]


def test_a_change_that_failed_on_every_box_is_shown_again(bw: Bw, tmp_path: Path, marks: Path) -> None:
    plan = write_plan(tmp_path / "sweep.toml", marks, SPREAD)
    bw.ok("fanout", "up", str(plan))
    # A box that is up keeps what it watches: `up` refuses the change on both boxes.
    boxes = "".join(f'[[box]]\nname = "{b}"\nprofile = "local"\nwatch = ["other"]\n\n' for b in ("f1", "f2"))
    write_plan(plan, marks, SPREAD, boxes)
    r = bw("fanout", "up", str(plan), "--yes", "--json")
    assert r.returncode == 1 and all(b["error"].startswith("up: ") for b in json.loads(r.stdout)["boxes"])
    r = bw("fanout", "up", str(plan))  # no terminal: the difference is shown again, not applied
    assert r.returncode == 2, r.stderr
    assert "box f1: watch ['ckpt'] -> ['other']" in r.stderr and "box f2: watch" in r.stderr


def test_a_torn_down_box_stays_down_and_what_it_finished_never_runs_again_unasked(
    bw: Bw, tmp_path: Path, marks: Path
) -> None:
    failing = CELLS + '\n[[cell]]\nname = "d"\nbox = "f2"\nenv = { CELL_EXIT = "3" }\n'  # f2: c and d
    plan = write_plan(tmp_path / "sweep.toml", marks, failing, "", "--safetensors")
    plan.write_text(
        plan.read_text().replace('name = "sweep"\n', 'name = "sweep"\nroster = ["a", "b", "c"]\n')
    )
    bw.ok("fanout", "up", str(plan))
    wait_queues(bw, "f1")
    assert bw("queue", "f2", "sweep", "--wait", "--timeout", "90", timeout=120).returncode == 1  # d failed
    pulled = tmp_path / "pulled-f2"
    bw.ok("pull", "f2", "--to", str(pulled))
    bw.ok("verify", str(pulled))
    bw.ok("down", "f2", "--confirm", "f2")

    r = bw("fanout", "up", str(plan), "--json")  # the plan unchanged
    assert r.returncode == 0, r.stderr
    assert "box f2: torn down, not started again (`fanout up --restart-box f2` starts it)" in r.stderr
    # Only what its queue said done finished there; d failed, and says so (never "finished").
    assert "its cells c finished; cells d did not finish and wait for it (d: failed: exit 3 (job " in r.stderr
    got = {b["box"]: (b["up"], b["queued"]) for b in json.loads(r.stdout)["boxes"]}
    assert got == {"f1": ("running", []), "f2": ("down", [])}
    assert {x["box"]: x["status"] for x in bw.json("status")["boxes"]}["f2"] == "down"
    assert [len(runs(marks, c)) for c in "abcd"] == [1, 1, 1, 1]  # nothing that finished ran again

    # d, which did not finish, runs where the plan moves it.
    write_plan(plan, marks, CELLS + '\n[[cell]]\nname = "d"\nbox = "f1"\n', "", "--safetensors")
    plan.write_text(
        plan.read_text().replace('name = "sweep"\n', 'name = "sweep"\nroster = ["a", "b", "c"]\n')
    )
    r = bw("fanout", "up", str(plan), "--yes", "--json")
    assert {b["box"]: b["queued"] for b in json.loads(r.stdout)["boxes"]} == {"f1": ["d"], "f2": []}
    assert "cell d: runs on f1; it did not finish on f2: failed: exit 3" in r.stderr
    wait_queues(bw, "f1")

    # f2 brought up again by hand: a new run, whose sidecar knows nothing of c. It stays finished.
    bw.ok("up", "f2", "--profile", "local", "--workdir", str(tmp_path / "f2"), "--watch", "ckpt")
    r = bw("fanout", "up", str(plan), "--json", "--yes")  # (f2 was down when d left it: shown now)
    f2 = json.loads(r.stdout)["boxes"][1]
    assert (f2["up"], f2["queue"], f2["queued"]) == ("running", "none", []), r.stderr
    assert f2["held"]["c"].startswith("it finished on f2 in an earlier run (")
    assert [len(runs(marks, c)) for c in "abcd"] == [1, 1, 1, 2]
    doc = bw.json("fanout", "up", str(plan), "--rerun", "c")  # asked for: it runs once more
    assert {b["box"]: b["queued"] for b in doc["boxes"]} == {"f1": [], "f2": ["c"]}
    wait_queues(bw, "f2")
    assert [len(runs(marks, c)) for c in "abcd"] == [1, 1, 2, 2]


def test_a_plan_s_own_profile_file_is_taken_only_with_trust_plan(bw: Bw, tmp_path: Path) -> None:
    """A shared plan's profile_file names the commands `down` runs here (an unattended --when-safe
    too): one that is no shipped profile is refused, nothing started, unless --trust-plan."""
    shared = tmp_path / "shared"
    shared.mkdir()
    fake_profile(shared)  # its meter stop runs a program of the plan author's choosing, here
    plan = shared / "plan.toml"
    plan.write_text(
        'name = "p"\n[defaults]\ncommand = ["true"]\n\n[[box]]\nname = "g1"\n'
        'profile_file = "fakecloud.toml"\ninstance_id = "i-1"\n\n[[cell]]\nname = "a"\n'
    )
    r = bw("fanout", "up", str(plan))
    assert r.returncode == 2, r.stderr
    assert (
        f"{plan}:7: [[box]] 1 ('g1'): field profile_file: '{shared / 'fakecloud.toml'}' is no shipped"
        in r.stderr
    )
    assert "--trust-plan" in r.stderr and bw.json("status")["boxes"] == []  # nothing started or recorded
    provider(bw, tmp_path, "create", "i-1")  # (an instance its provider lists)
    doc = bw.json("fanout", "up", str(plan), "--trust-plan")
    assert [(b["box"], b["up"], b["error"]) for b in doc["boxes"]] == [("g1", "started", "")]
    # Its meter stop edited since it was trusted (second review): a change of the plan, shown and
    # confirmed, never taken again silently.
    prof = shared / "fakecloud.toml"
    prof.write_text(prof.read_text().replace('"delete"', '"destroy-everything"'))
    r = bw("fanout", "up", str(plan), "--trust-plan")
    assert r.returncode == 2 and "profile_digest" in r.stderr and "--yes" in r.stderr, r.stderr
    assert bw("fanout", "up", str(plan), "--trust-plan", "--yes").returncode == 0


def test_two_boxes_that_would_watch_one_directory_are_refused(bw: Bw, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    boxes = (
        f'[[box]]\nname = "f1"\nprofile = "local"\nworkdir = "{shared}"\n\n'
        f'[[box]]\nname = "f2"\nprofile = "local"\nworkdir = "{shared}"\n\n'
    )
    plan = write_plan(tmp_path / "sweep.toml", tmp_path, CELLS.replace('box = "f1"\n', ""), boxes)
    r = bw("fanout", "up", str(plan))
    assert r.returncode == 2 and "boxes f1 and f2 both watch" in r.stderr
    assert not bw.sidecar_pids()


def test_what_a_box_finished_is_known_after_its_down_even_if_no_one_read_its_queue(
    bw: Bw, tmp_path: Path, marks: Path
) -> None:
    """The gate reads the box's queues before its teardown: a box torn down without `queue` or
    `watch` ever reading them still has its finished cells known to the next `fanout up`."""
    plan = write_plan(tmp_path / "sweep.toml", marks, CELLS, "", "--safetensors")
    bw.ok("fanout", "up", str(plan))

    def f2_done() -> bool:
        (row,) = bw.json("status", "f2")["boxes"]  # (status reads no queue)
        return row["jobs_total"] == 1 and row["jobs_running"] == 0 and row["claims"] == row["durable"] > 0

    wait_until(f2_done, timeout=90, what="f2's cell done and durable")
    pulled = tmp_path / "pulled-f2"
    bw.ok("pull", "f2", "--to", str(pulled))
    bw.ok("verify", str(pulled))
    bw.ok("down", "f2", "--confirm", "f2")
    r = bw("fanout", "up", str(plan), "--json")
    assert r.returncode == 0 and "its cells b finished" in r.stderr, r.stderr
    assert len(runs(marks, "b")) == 1


def test_a_box_whose_teardown_did_not_finish_is_never_called_torn_down_nor_restarted(
    bw: Bw, tmp_path: Path, marks: Path
) -> None:
    """Second review of issue 25: fanout called a box whose teardown was interrupted "torn down"
    (its meter may still run), and --restart-box brought it up, dropping the unfinished teardown."""
    from controller.state import State

    plan = write_plan(tmp_path / "sweep.toml", marks, CELLS)
    bw.ok("fanout", "up", str(plan))
    wait_queues(bw, "f1", "f2")
    state = State(bw.home)
    try:  # what a SIGTERM during f2's release leaves
        state.step(state.get("f2").with_(status="tearing-down"), "release", "no answer yet")
    finally:
        state.close()
    r = bw("fanout", "up", str(plan), "--json")
    assert r.returncode == 0, r.stderr
    assert "box f2: its teardown did not finish (tearing-down" in r.stderr and "torn down" not in r.stderr
    assert {b["box"]: b["up"] for b in json.loads(r.stdout)["boxes"]}["f2"] == "tearing-down"
    r = bw("fanout", "up", str(plan), "--restart-box", "f2")
    assert r.returncode == 2 and "boxwarden down f2 --confirm f2` continues it first" in r.stderr
    assert bw.json("status", "f2")["boxes"][0]["status"] == "tearing-down"
