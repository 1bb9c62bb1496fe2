"""Cell queues through the real CLI on a real local box: `run --queue cells.toml --wait` exits
nonzero when a cell failed; the sidecar killed mid-queue and `up` again continues at the right cell
and runs no cell twice; `run --cell a --cell b -- CMD` is the same queue from flags; `queue`
shows, follows and stops a queue."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tests.cellscript import cell_argv
from tests.cellscript import runs as cell_runs
from tests.conftest import Bw, wait_until


def cells_toml(path: Path, marks: Path, cells: list[tuple[str, dict[str, str], list[str]]]) -> Path:
    out = path.parent / "work" / "ckpt"  # the box's watched dir (the bw fixture's workdir)
    lines = [f"[defaults]\ncommand = {json.dumps(cell_argv(marks, out))}\n"]
    for name, env, extra in cells:
        table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
        lines.append(f'[[cell]]\nname = "{name}"\nenv = {{ {table} }}\n')
        if extra:
            lines.append(f"command = {json.dumps(cell_argv(marks, out, *extra))}\n")
    path.write_text("\n".join(lines))
    return path


def runs(marks: Path, cell: str) -> int:
    return len(cell_runs(marks, cell))


def test_a_queue_file_runs_its_cells_and_a_failed_cell_fails_the_wait(bw: Bw, tmp_path: Path) -> None:
    bw.up("b1")
    marks = tmp_path / "marks"
    marks.mkdir()
    f = cells_toml(
        tmp_path / "sweep.toml", marks, [("a", {}, []), ("b", {"CELL_EXIT": "3"}, []), ("c", {}, [])]
    )
    r = bw("run", "b1", "--queue", str(f), "--wait", "--json", timeout=180)
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    assert doc["name"] == "sweep" and doc["result"] == "failed" and doc["over"]
    cells = {c["cell"]: c for c in doc["cells"]}
    assert {k: c["state"] for k, c in cells.items()} == {"a": "done", "b": "failed", "c": "done"}
    assert cells["b"]["exit_code"] == 3 and cells["b"]["detail"] == "exit 3"
    assert cells["a"]["durability"] == cells["c"]["durability"] == "durable"
    assert [runs(marks, c) for c in "abc"] == [1, 1, 1]

    # The same file again: a new pass runs only b (fails again); a and c are never run twice.
    r = bw("run", "b1", "--queue", str(f), "--wait", timeout=180)
    assert r.returncode == 1
    assert "cell b failed (exit 3)" in r.stderr
    assert [runs(marks, c) for c in "abc"] == [1, 2, 1]
    shown = bw("queue", "b1", "sweep")
    assert shown.returncode == 1 and "skipped" in shown.stderr


def test_a_killed_sidecar_brought_up_again_continues_the_queue(bw: Bw, tmp_path: Path) -> None:
    bw.up("b2")
    marks = tmp_path / "marks"
    marks.mkdir()
    f = cells_toml(
        tmp_path / "q.toml",
        marks,
        [("a", {}, []), ("b", {"CELL_EXIT": "2"}, []), ("c", {}, ["--gate"]), ("d", {}, [])],
    )
    try:
        bw.ok("run", "b2", "--queue", str(f))
        wait_until(lambda: runs(marks, "c") == 1, timeout=60, what="cell c to start")
        (pid,) = bw.sidecar_pids()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), what="the sidecar to die")
        (marks / "c.gate").touch()  # c ends while no sidecar runs
        bw.up("b2")
        r = bw("queue", "b2", "q", "--wait", "--timeout", "120", "--json", timeout=180)
        assert r.returncode == 1, r.stderr
        doc = json.loads(r.stdout)
        assert [c["state"] for c in doc["cells"]] == ["done", "failed", "done", "done"]
        assert [runs(marks, c) for c in "abcd"] == [1, 1, 1, 1]
    finally:
        (marks / "c.gate").touch()


def test_cells_from_flags_make_a_queue_and_stop_ends_it(bw: Bw, tmp_path: Path) -> None:
    bw.up("b3")
    marks = tmp_path / "marks"
    marks.mkdir()
    try:
        r = bw(
            "run",
            "b3",
            "--json",
            "--cell",
            "x",
            "--cell",
            "y",
            "--",
            *cell_argv(marks, bw.cwd / "ckpt", "--gate"),
        )
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["name"].startswith("cells-") and doc["started"] is True
        assert [c["cell"] for c in doc["cells"]] == ["x", "y"]
        wait_until(lambda: runs(marks, "x") == 1, timeout=60)
        stopped = bw("queue", "b3", doc["name"], "--stop", "--grace", "1", "--json")
        assert stopped.returncode == 1
        assert [c["state"] for c in json.loads(stopped.stdout)["cells"]] == ["failed", "cancelled"]
        listing = bw.json("queue", "b3")
        assert [q["name"] for q in listing["queues"]] == [doc["name"]]
        assert runs(marks, "y") == 0
        # One --cell is a plain job; "{cell}" in its command is the cell there too.
        r = bw("run", "b3", "--json", "--cell", "z", "--", "sh", "-c", "echo this is {cell}")
        assert r.returncode == 0, r.stderr
        job = json.loads(r.stdout)["id"]
        wait_until(lambda: "this is z" in bw("logs", "b3", "--job", job).stdout)
    finally:
        (marks / "x.gate").touch()
        (marks / "y.gate").touch()


def test_queue_usage_errors(bw: Bw, tmp_path: Path) -> None:
    f = tmp_path / "q.toml"
    f.write_text('[[cell]]\nname = "a"\ncommand = ["true"]\n')
    r = bw("run", "nobox", "--queue", str(f), "--", "true")
    assert r.returncode == 2 and "takes its cells, commands and name from the file" in r.stderr
    r = bw("run", "nobox", "--cell", "a", "--cell", "b")
    assert r.returncode == 2 and "give the command every cell runs" in r.stderr
    r = bw("queue", "nobox", "--wait")
    assert r.returncode == 2 and "need the QUEUE's name" in r.stderr
    f.write_text('[[cell]]\nname = "a"\ncommand = "python train.py"\n')
    r = bw("run", "nobox", "--queue", str(f))
    assert r.returncode == 2 and "never a shell string" in r.stderr
