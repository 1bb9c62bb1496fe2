"""`fanout up PLAN` through the real CLI with real local boxes: every box comes up, each gets its
cells as a queue, a second run changes nothing and runs no cell again, a changed plan is shown and
applied only when confirmed, and two boxes that would watch one directory are refused."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cellscript import cell_argv, runs
from tests.conftest import Bw


def write_plan(path: Path, marks: Path, cells: str, boxes: str = "") -> Path:
    argv = cell_argv(marks, Path("ckpt"))  # relative: each box's own watched dir (its workdir/ckpt)
    path.write_text(
        f'name = "sweep"\n[defaults]\ncommand = {json.dumps(argv)}\n\n'
        + (boxes or '[[box]]\nname = "f1"\nprofile = "local"\n\n[[box]]\nname = "f2"\nprofile = "local"\n\n')
        + cells
    )
    return path


CELLS = '[[cell]]\nname = "a"\nbox = "f1"\n\n[[cell]]\nname = "b"\n\n[[cell]]\nname = "c"\n'


def test_fanout_up_spreads_the_cells_and_a_second_run_changes_nothing(bw: Bw, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    plan = write_plan(tmp_path / "sweep.toml", marks, CELLS)
    doc = bw.json("fanout", "up", str(plan))
    got = {b["box"]: (b["up"], b["queue"], b["cells"], b["error"]) for b in doc["boxes"]}
    assert got == {"f1": ("started", "queued", ["a", "c"], ""), "f2": ("started", "queued", ["b"], "")}
    for box in ("f1", "f2"):
        r = bw("queue", box, "sweep", "--wait", "--timeout", "90", "--json", timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["result"] == "ok"
    assert [len(runs(marks, c)) for c in "abc"] == [1, 1, 1]
    # Each box watched its own directory, and holds its own cells' checkpoints.
    assert sorted(p.name for p in (tmp_path / "f1" / "ckpt").iterdir()) == ["a", "c"]
    assert sorted(p.name for p in (tmp_path / "f2" / "ckpt").iterdir()) == ["b"]

    again = bw.json("fanout", "up", str(plan))
    assert {b["box"]: b["up"] for b in again["boxes"]} == {"f1": "running", "f2": "running"}
    for box in ("f1", "f2"):
        r = bw("queue", box, "sweep", "--wait", "--timeout", "60", "--json", timeout=120)
        assert {c["state"] for c in json.loads(r.stdout)["cells"]} == {"skipped"}
    assert [len(runs(marks, c)) for c in "abc"] == [1, 1, 1]  # no cell ran again


def test_a_changed_plan_is_shown_and_applied_only_when_confirmed(bw: Bw, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
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
