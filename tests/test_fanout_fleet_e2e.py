"""Issue 10's end to end: three boxes (two over the real sshd, one local) and six cells from one plan,
one cell failing and the local box's sidecar killed mid-run. `watch` in a real pseudo-terminal
(tmux) and `status --json` show the states; `pull --all` brings the reachable boxes home; `down
--all` tears down exactly the box whose evidence is complete and lists the others with their
reason codes."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tests.conftest import exclusive, wait_until
from tests.test_remote_e2e import (  # noqa: F401 - fixtures
    Remote,
    _exit_master,
    _wheelhouse,
    remote,
    venv_template,
    wheel_cache,
)
from tests.test_watch_e2e import screen, tmux

# A cell: fails at once with $FAIL; else saves a checkpoint (safetensors) under ckpt/<cell>/ and, with
# $GATE, waits for that file (a minute at most).
CELL = r"""
import json, os, struct, sys, time, pathlib
if os.environ.get("FAIL"):
    sys.exit(3)
out = pathlib.Path("ckpt", os.environ["BOXWARDEN_CELL"])
out.mkdir(parents=True, exist_ok=True)
data = os.urandom(4000)
head = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
head += b" " * (-len(head) % 8)
tmp = out / "step-1.safetensors.tmp"
tmp.write_bytes(struct.pack("<Q", len(head)) + head + data)
os.replace(tmp, out / "step-1.safetensors")
gate = os.environ.get("GATE")
deadline = time.monotonic() + 60
while gate and not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def plan_text(remote: Remote, gate: Path) -> str:  # noqa: F811
    boxes = "".join(
        f'[[box]]\nname = "{n}"\nprofile_file = "{remote.profile}"\nhost = "{n}"\ninstance_id = "i-{n}"\n\n'
        for n in ("r1", "r2")
    )
    boxes += '[[box]]\nname = "here"\nprofile = "local"\n\n'
    cells = [("a", "r1", ""), ("b", "r1", ""), ("c", "r2", ""), ("d", "r2", 'FAIL = "1"')]
    cells += [("e", "here", f'GATE = "{gate}"'), ("f", "here", "")]
    text = f'name = "abl"\n[defaults]\ncommand = {json.dumps(["python3", "-c", CELL])}\n\n{boxes}'
    for name, box, env in cells:
        text += f'[[cell]]\nname = "{name}"\nbox = "{box}"\n' + (f"env = {{ {env} }}\n" if env else "") + "\n"
    return text


def test_a_plan_over_three_boxes_watched_pulled_and_torn_down_where_safe(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    bw = remote.bw
    r1, r2 = remote.boxes("r1"), remote.boxes("r2")
    for box in (r1, r2):
        remote.provider("create", f"i-{box.alias}", "--linger", "1")
        remote.up(box, seeded=True)  # the venv from the session's template: this test is not about it
    gate = tmp_path / "gate"
    plan = tmp_path / "plan.toml"
    plan.write_text(plan_text(remote, gate))
    try:
        doc = bw.json("fanout", "up", str(plan), "--trust-plan")  # its profile file is the test's own
        got = {b["box"]: (b["up"], b["queue"], b["cells"]) for b in doc["boxes"]}
        assert got == {
            "r1": ("running", "queued", ["a", "b"]),
            "r2": ("running", "queued", ["c", "d"]),
            "here": ("started", "queued", ["e", "f"]),
        }
        assert bw("queue", "r1", "abl", "--wait", "--timeout", "120", timeout=180).returncode == 0
        failed = bw("queue", "r2", "abl", "--wait", "--timeout", "120", "--json", timeout=180)
        assert failed.returncode == 1
        assert [(c["cell"], c["state"]) for c in json.loads(failed.stdout)["cells"]] == [
            ("c", "done"),
            ("d", "failed"),
        ]

        def here_running() -> bool:
            q = bw.json("queue", "here", "abl", code=4)
            return [c["state"] for c in q["cells"]] == ["running", "pending"]

        wait_until(here_running, timeout=60, what="cell e running on the local box")
        argv = [sys.executable, "-m", "controller", "watch", str(plan), "--interval", "0.5"]
        with tmux(bw, tmp_path, argv) as sock:

            def row(name: str) -> str:
                return next((x for x in screen(sock).splitlines() if x.startswith(f"{name} ")), "")

            wait_until(
                lambda: "2/2" in row("r1") and "1/2 1F" in row("r2") and "0/2" in row("here"), timeout=60
            )
            cell_d = [x for x in screen(sock).splitlines() if x.split()[:1] == ["d"]]
            assert cell_d and "failed exit 3" in " ".join(cell_d[0].split())
            pid = int((bw.home / "boxes" / "here" / "sidecar" / "sidecar.pid").read_text())
            os.kill(pid, signal.SIGKILL)  # the local box's sidecar dies mid-run
            wait_until(lambda: "UNREACHABLE" in row("here"), timeout=30, what="here unreachable")
            assert "2/2" in row("r1")  # the other rows go on
        rows = {r["box"]: r for r in bw.json("status")["boxes"]}
        assert rows["here"]["unreachable"] is True
        assert rows["r1"]["claims"] == rows["r1"]["durable"] == 2 and rows["r2"]["claims"] == 1

        pulled = bw("pull", "--all", "--json", timeout=300)
        assert pulled.returncode == 1  # here does not answer; the others came home
        by_box = {b["box"]: b for b in json.loads(pulled.stdout)["boxes"]}
        assert by_box["r1"]["error"] is None and by_box["r2"]["error"] is None and by_box["here"]["error"]
        for name in ("r1", "r2"):
            bw("verify", str(bw.cwd / f"pulled-{name}"))  # r2's misses its roster cell d: not verified

        r = bw("down", "--all", "--confirm-count", "1", "--json", timeout=300)
        assert r.returncode == 3, r.stderr
        outcome = {b["box"]: b for b in json.loads(r.stdout)["boxes"]}
        assert outcome["r1"]["outcome"] == "torn-down"
        assert outcome["r2"]["outcome"] == "refused" and outcome["here"]["outcome"] == "refused"
        assert "SIDECAR_UNREACHABLE" in [x["code"] for x in outcome["here"]["reasons"]]
        assert outcome["r2"]["reasons"], outcome["r2"]
        status = {x["box"]: x["status"] for x in bw.json("status")["boxes"]}
        assert status == {"r1": "down", "r2": "up", "here": "up"}
    finally:
        gate.touch()


def test_a_plan_whose_ssh_option_runs_a_command_is_taken_only_with_trust_plan(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    bw, box = remote.bw, remote.boxes("r1")
    with exclusive(remote.template.lock):  # no template yet: the fan-out's `up` installs for real
        remote.template.seed(box, _wheelhouse(box, remote.wheel_cache).digest)
    ran = tmp_path / "proxy-ran"
    proxy = f"ProxyCommand=sh -c 'echo ran >> {ran}; exec ssh -F {box.config} -W %h:%p {box.alias}'"
    plan = tmp_path / "plan.toml"
    plan.write_text(
        f'name = "pc"\n[defaults]\ncommand = ["true"]\n\n[[box]]\nname = "{box.alias}"\n'
        f'profile_file = "{remote.profile}"\nhost = "{box.alias}"\ninstance_id = "i-{box.alias}"\n'
        f'ssh_options = [\n  {json.dumps(proxy)},\n]\n\n[[cell]]\nname = "a"\n'
    )
    refused = bw("fanout", "up", str(plan))
    assert refused.returncode == 2, refused.stderr
    where = f"{plan}:11: [[box]] 1 ('{box.alias}'): field ssh_options"
    assert f"{where}: ProxyCommand runs a command" in refused.stderr
    profile = f"{plan}:7: [[box]] 1 ('{box.alias}'): field profile_file: '{remote.profile}' is no shipped"
    assert profile in refused.stderr  # every ask at once
    assert "--trust-plan" in refused.stderr
    assert not ran.exists() and bw.json("status")["boxes"] == []  # nothing ran, nothing was recorded

    remote.running(("--instance-id", f"i-{box.alias}"))  # (an instance its provider lists)
    doc = bw.json("fanout", "up", str(plan), "--trust-plan")
    assert [(b["box"], b["up"], b["error"]) for b in doc["boxes"]] == [(box.alias, "started", "")]
    assert ran.read_text().splitlines()  # the link went through the plan's ProxyCommand
    # The box keeps the options it was brought up with: a new link (no master left) runs it again.
    _exit_master(bw, box)
    before = len(ran.read_text().splitlines())
    (row,) = bw.json("status", box.alias)["boxes"]
    assert row["status"] == "up" and row["unreachable"] is False
    assert len(ran.read_text().splitlines()) > before
