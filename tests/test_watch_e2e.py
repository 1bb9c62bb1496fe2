"""`watch PLAN` in a real pseudo-terminal (tmux, 80 columns, the screen read with capture-pane) over
two real local boxes: each box's row and cells, an alert highlighted and printed as a log line, and
a box whose sidecar is killed shown unreachable while the other row goes on updating."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import Bw, wait_until

# A cell: logs a step and a loss, saves a checkpoint under the box's ckpt/<cell>/, then waits for its
# gate file (a minute at most); the cell "bad" logs a NaN loss.
CELL = r"""
import os, sys, time, pathlib
cell, gates = os.environ["BOXWARDEN_CELL"], pathlib.Path(sys.argv[1])
print("step 7 loss=%s" % ("nan" if cell == "bad" else "0.25"), flush=True)
pathlib.Path("ckpt", cell).mkdir(parents=True, exist_ok=True)
pathlib.Path("ckpt", cell, "step-7.pt").write_bytes(b"\x80" + os.urandom(2048))
deadline = time.monotonic() + 60
while not (gates / cell).exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""

PLAN = """\
name = "sweep"
[defaults]
command = {command}

[[box]]
name = "w1"
profile = "local"

[[box]]
name = "w2"
profile = "local"

[[cell]]
name = "good"
box = "w1"

[[cell]]
name = "bad"
box = "w2"
"""


@contextlib.contextmanager
def tmux(bw: Bw, cwd: Path, argv: list[str]) -> Iterator[Path]:
    """`argv` in a detached tmux session of its own (its own server socket), 80x24."""
    sock = cwd / "tmux.sock"
    env = " ".join(f"{k}={v}" for k, v in (("BOXWARDEN_HOME", bw.home), ("PYTHONPATH", bw.env["PYTHONPATH"])))
    cmd = f"env {env} " + " ".join(argv)
    subprocess.run(
        ["tmux", "-S", str(sock), "new-session", "-d", "-x", "80", "-y", "24", "-c", str(cwd), cmd],
        check=True,
        env={**os.environ, "TERM": "xterm-256color"},
    )
    try:
        yield sock
    finally:
        subprocess.run(["tmux", "-S", str(sock), "kill-server"], capture_output=True)


def screen(sock: Path) -> str:
    r = subprocess.run(
        ["tmux", "-S", str(sock), "capture-pane", "-p", "-S", "-100"], capture_output=True, text=True
    )
    return r.stdout


def test_watch_shows_each_box_its_cells_an_alert_and_an_unreachable_box(bw: Bw, tmp_path: Path) -> None:
    gates = tmp_path / "gates"
    gates.mkdir()
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN.format(command=json.dumps([sys.executable, "-c", CELL, str(gates)])))
    try:
        bw.ok("fanout", "up", str(plan))
        argv = [sys.executable, "-m", "controller", "watch", str(plan), "--interval", "0.3"]
        with tmux(bw, tmp_path, argv) as sock:

            def w1_row() -> str:
                return next((x for x in screen(sock).splitlines() if x.startswith("w1 ")), "")

            row = wait_until(lambda: "7 0.25" in (r := w1_row()) and r, timeout=60, what="w1's step and loss")
            assert "1 job" in row and "0/1" in row
            seen = wait_until(lambda: "running 7 0.25" in (x := screen(sock)) and x, timeout=30)
            good = next(x for x in seen.splitlines() if x.split()[:1] == ["good"])
            assert "running 7 0.25" in good  # the cell's own job: its step and loss
            assert "bad" in seen
            assert all(len(line) <= 80 for line in seen.splitlines())
            # The NaN: an alert, printed once as a log line above the view.
            alert = wait_until(
                lambda: [x for x in screen(sock).splitlines() if "LOSS_NONFINITE" in x], timeout=30
            )
            assert alert[0].startswith("w2: LOSS_NONFINITE")
            # w2's sidecar dies: its row says so; w1's row goes on (its cell ends and the view shows it).
            pid = int((bw.home / "boxes" / "w2" / "sidecar" / "sidecar.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: "UNREACHABLE" in screen(sock), timeout=30, what="w2 unreachable")
            (gates / "good").touch()
            wait_until(lambda: "1/1" in w1_row(), timeout=30, what="w1's cell done while w2 does not answer")

        # status --json says the same, in figures.
        def rows() -> dict[str, dict[str, object]]:
            return {r["box"]: r for r in bw.json("status")["boxes"]}

        # (the health snapshot is taken once a second: it may lag the queue by one)
        got = wait_until(lambda: (r := rows())["w1"]["jobs_running"] == 0 and r, timeout=10)
        assert got["w2"]["unreachable"] is True and got["w1"]["claims"] == got["w1"]["durable"] == 1
    finally:
        for cell in ("good", "bad"):
            (gates / cell).touch()


def test_a_box_left_idle_raises_box_idle_once_with_its_cost(bw: Bw, tmp_path: Path) -> None:
    bw.up("i1", "--price-per-hour", "2.5")
    r = bw("run", "i1", "--json", "--", "true")
    assert r.returncode == 0, r.stderr
    wait_until(lambda: bw.json("status", "i1")["boxes"][0]["jobs_ended_unix_ns"], timeout=30)
    argv = [sys.executable, "-m", "controller", "watch", "i1", "--interval", "0.3", "--idle-minutes", "0.01"]
    with tmux(bw, tmp_path, argv) as sock:
        line = wait_until(lambda: [x for x in screen(sock).splitlines() if "BOX_IDLE" in x], timeout=30)[0]
        assert line.startswith("i1: BOX_IDLE: no job has run for") and "at 2.5/h" in line and "so far" in line

        def clock() -> str:
            return screen(sock).strip().splitlines()[-1].strip()

        first = clock()
        second = wait_until(lambda: (c := clock()) != first and c, timeout=10, what="a redraw")
        wait_until(lambda: clock() not in (first, second), timeout=10, what="another redraw")
        assert sum("BOX_IDLE" in x for x in screen(sock).splitlines()) == 1  # once per episode
