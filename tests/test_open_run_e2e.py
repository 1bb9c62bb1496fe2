"""A run is open on its box until a teardown closes it, and a closed run is over for every
controller (issue 25, sixth review): every way a run ends closes it (a `down` continued with
`--resend-stop`, a box closed with `--box-gone` whose state the next pod finds on its volume), a
start that fails leaves neither an open mark nor a config behind, and a torn-down run is never
started again, whoever asks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

from controller.state import State
from tests.conftest import Bw, pid_alive, save_weights, wait_until
from tests.controller.test_meter_stop import calls, fake_profile, provider
from tests.sshbox import free_port
from tests.test_box_gone_e2e import no_meter, point_at
from tests.test_identity_e2e import second_controller, up_as
from tests.test_remote_e2e import Remote, _exit_master, remote, venv_template, wheel_cache, write_as_box  # noqa: F401 - fixtures


def marks(root: Path, name: str) -> list[Path]:
    return sorted(p for p in root.rglob("run-open") if f"/{name}/sidecar/" in str(p))


def test_a_run_torn_down_by_one_controller_is_started_again_by_none(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A's box h1 runs R; B adopts it, pulls, verifies and tears it down (the box marks R over).
    A's record still says up: its plain `up` started R again over the copies B proved; and B's
    `up --run-id R` of a run A tore down started it again (another controller's record knows
    nothing of the box's mark)."""
    a = remote.bw
    box = remote.boxes("h1")
    remote.up(box, "--run-id", "exp1", seeded=True)
    write_as_box(box, "ckpt/a.bin", "A's weights")
    a.wait_durable("h1", 1)
    b = second_controller(remote, tmp_path)
    up = ("up", "h1", "--profile-file", str(remote.profile), "--host", "h1", "--instance-id", "i-h1")
    try:
        assert b(*up, "--adopt", "--json", timeout=300).returncode == 0
        b.ok("pull", "h1", "--to", str(b.cwd / "pb"))
        b.ok("verify", str(b.cwd / "pb"))
        assert b("down", "h1", "--confirm", "h1", "--json", timeout=200).returncode == 0
        sd = box.home / ".boxwarden/boxes/h1/sidecar"
        assert (sd / "torn-down").read_text().strip() == "exp1" and not (sd / "run-open").exists()
        remote.provider("create", "i-h1")  # (the instance still there: a stop held, or reversible)
        r = a(*up, "--watch", "ckpt", "--json", timeout=300)  # A's record: run exp1, up
        assert r.returncode == 3 and "run exp1 of box 'h1' was torn down on the box" in r.stderr, r.stderr
        r = b(*up, "--watch", "ckpt", "--run-id", "exp1", "--json", timeout=300)  # B's record: down
        assert r.returncode != 0 and "torn down" in r.stderr, r.stderr
        stored = sorted(p.read_text() for p in (box.home / "boxwarden").rglob("a.bin"))
        assert stored == ["A's weights"], stored  # the proven copy, nothing over it
    finally:
        _exit_master(b, box)


def test_a_teardown_continued_with_resend_stop_closes_its_run(bw: Bw, tmp_path: Path) -> None:
    """A `down` cut after its sidecar's Shutdown, finished with `--resend-stop` as the refusal says:
    the run stayed open on the box, so `up` of the name was refused as another controller's run
    and `--adopt` as a torn-down one."""
    provider(bw, tmp_path, "create", "i-1")
    (bw.cwd / "x").mkdir()
    args = (
        "--profile-file",
        str(fake_profile(tmp_path)),
        "--instance-id",
        "i-1",
        "--workdir",
        str(bw.cwd / "x"),
    )
    bw.ok("up", "x", *args, "--watch", "ckpt")
    save_weights(bw.cwd / "x" / "ckpt" / "a.safetensors", seed=1)
    bw.wait_durable("x", 1)
    bw.ok("pull", "x", "--to", str(bw.cwd / "px"))
    bw.ok("verify", str(bw.cwd / "px"))
    (pid,) = bw.sidecar_pids()
    state = State(bw.home)
    try:  # a `down` cut after it asked the sidecar to stop, before its last look on the box
        state.step(state.get("x").with_(status="tearing-down"), "shutdown", f"pid {pid}")
    finally:
        state.close()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="x's sidecar gone")
    sd = bw.home / "boxes/x/sidecar"
    assert (sd / "run-open").exists()
    r = bw("down", "x", "--confirm", "x", "--resend-stop", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    assert not (sd / "run-open").exists() and (sd / "torn-down").exists()
    provider(bw, tmp_path, "create", "i-1")
    r = bw("up", "x", *args, "--watch", "ckpt")  # a new run of the name
    assert r.returncode == 0, r.stderr
    assert ["delete", "i-1"] in calls(tmp_path)


def test_a_box_closed_while_gone_holds_no_later_box_on_its_volume(
    remote: Remote,  # noqa: F811
) -> None:
    """A box whose state is on a network volume, closed with `--box-gone` after its pod vanished:
    its run stayed open on the volume, so the next pod's box had its stop held by it for ever, and
    the name could not be brought up or adopted again."""
    bw = remote.bw
    box = remote.boxes("h1")
    remote.profile.write_text(remote.profile.read_text().replace('path = "~"', 'path = "~/persist"'))
    remote.profile = no_meter(remote)
    assert box.run_as_box(["mkdir", "-p", str(box.home / "persist")]).returncode == 0
    text = box.config.read_text()
    port = re.search(r"Port (\d+)\n", text[text.index("Host h1\n") :])
    assert port is not None

    def up(name: str) -> subprocess.CompletedProcess[str]:
        return bw("up", name, "--profile-file", str(remote.profile), "--host", "h1",
                  "--watch", f"ckpt-{name}", "--state-on-durable", "--json", timeout=400)  # fmt: skip

    r = up("x")
    assert r.returncode == 0, r.stderr
    pid = json.loads(r.stdout)["pid"]
    write_as_box(box, "ckpt-x/a.bin", "x weights")
    bw.wait_durable("x", 1)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="x's sidecar gone")
    bw.ok("pull", "x", "--from", "durable", "--to", str(bw.cwd / "px"))
    bw.ok("verify", str(bw.cwd / "px"))
    point_at(box, free_port())  # the pod is gone
    gone = ("--box-gone", "--console-shows-gone")
    assert (
        bw("down", "x", "--confirm", "x", *gone, "--json", timeout=120).returncode == 1
    )  # the console steps
    assert bw("down", "x", "--confirm", "x", "--meter-stopped", "--json", timeout=120).returncode == 0
    point_at(box, int(port.group(1)))  # a new pod, the same volume
    assert marks(box.home / "persist", "x")  # (the teardown could not reach it to close the run)
    assert up("y").returncode == 0
    write_as_box(box, "ckpt-y/b.bin", "y weights")
    bw.wait_durable("y", 1)
    bw.ok("pull", "y", "--to", str(bw.cwd / "py"))
    bw.ok("verify", str(bw.cwd / "py"))
    r = bw("down", "y", "--confirm", "y", "--json", timeout=200)  # not held by x: this controller closed it
    assert r.returncode == 1 and "METER_HELD" not in r.stderr and "Release it." in r.stderr, r.stderr
    assert bw("down", "y", "--confirm", "y", "--meter-stopped", "--json", timeout=120).returncode == 0
    r = up("x")  # the name again: a new run on the volume
    assert r.returncode == 0, r.stderr
    _exit_master(bw, box)


def test_a_start_that_fails_leaves_no_open_run_and_no_config(
    remote: Remote,  # noqa: F811
    bw: Bw,
) -> None:
    """A start whose root could not be registered (a full or read-only home) stopped its sidecar
    but kept its open-run mark: the same `up` was refused as another controller's run, and another
    box's stop on the instance was held by a run no controller knew. A first start whose sidecar
    exited (its metrics port taken) kept a config naming a run that never ran: the same `up` with
    another port was refused, and `--adopt` took the failed settings."""
    a = remote.bw
    box = remote.boxes("h1")
    up_as(remote, box, "bb01", "--workdir", "~/bb", "--watch", "ckpt")  # instance i-bb01
    assert box.run_as_box(["sh", "-c", "echo x > ~/.boxwarden/roots"]).returncode == 0  # no room
    args = ("up", "sx01", "--profile-file", str(remote.profile), "--host", box.alias, "--instance-id",
            "i-bb01", "--workdir", "~/sx", "--watch", "ckpt", "--state-on-durable")  # fmt: skip
    assert a(*args, timeout=300).returncode != 0
    assert marks(box.home, "sx01") == []
    assert box.run_as_box(["rm", "-f", str(box.home / ".boxwarden/roots")]).returncode == 0  # room again
    r = a(*args, timeout=300)
    assert r.returncode == 0, r.stderr
    _exit_master(a, box)

    port, other = free_port(), free_port()
    for n in ("a", "b"):
        (bw.cwd / n).mkdir()
    local = ("--profile", "local", "--watch", "ckpt")
    bw.ok("up", "a", *local, "--workdir", str(bw.cwd / "a"), "--metrics-port", str(port))
    r = bw("up", "b", *local, "--workdir", str(bw.cwd / "b"), "--metrics-port", str(port))
    assert r.returncode != 0 and not (bw.home / "boxes/b/sidecar.json").exists(), r.stderr
    bw.ok("up", "b", *local, "--workdir", str(bw.cwd / "b"), "--metrics-port", str(other))


def test_every_run_torn_down_in_a_state_dir_stays_over(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Seventh review: the box kept only its last torn-down run; another controller's `up --run-id`
    of an older one started it again over the copies this controller had proven."""
    a = remote.bw
    box = remote.boxes("h1")
    up = (
        "up",
        "h1",
        "--profile-file",
        str(remote.profile),
        "--host",
        "h1",
        "--instance-id",
        "i-h1",
        "--watch",
        "ckpt",
    )
    b = second_controller(remote, tmp_path)
    try:
        for run in ("exp1", "exp2"):
            remote.provider("create", "i-h1", "--linger", "1")
            if run == "exp1":
                remote.up(box, "--run-id", run, seeded=True)
            else:
                assert a(*up, "--run-id", run, "--json", timeout=300).returncode == 0
            write_as_box(box, "ckpt/a.bin", f"A's {run} weights")
            a.wait_durable("h1", 1)
            a.ok("pull", "h1", "--to", str(a.cwd / f"p{run}"))
            a.ok("verify", str(a.cwd / f"p{run}"))
            assert a("down", "h1", "--confirm", "h1", "--json", timeout=200).returncode == 0
        remote.provider("create", "i-h1", "--linger", "1")
        r = b(*up, "--run-id", "exp1", "--json", timeout=300)
        assert r.returncode == 3 and "run exp1 of box 'h1' was torn down on the box" in r.stderr, r.stderr
        stored = sorted(p.read_text() for p in (box.home / "boxwarden" / "h1" / "exp1").rglob("a.bin"))
        assert stored == ["A's exp1 weights"], stored
    finally:
        _exit_master(a, box)
        _exit_master(b, box)
