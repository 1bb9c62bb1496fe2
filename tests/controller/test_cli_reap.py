"""`boxwarden reap`: the real CLI against a real sidecar whose GPU readings are recorded ones naming
a real process of this test's: it is ended and the CLI says so; a refusal exits 1 with the sidecar's
reason; bad options are usage errors that reach no box."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from controller.state import Box, State
from tests.conftest import Bw, pid_alive
from tests.sidecar.daemon import Daemon, running
from tests.sidecar.test_reap import record, started


def cli_for(tmp_path: Path, d: Daemon) -> Bw:
    """The CLI with a controller state that knows box t1 as the local sidecar `d` (its name)."""
    bw = Bw(tmp_path / "home", tmp_path)
    state = State(bw.home)
    state.put(
        Box(
            name="t1",
            profile="local",
            box_dir=str(bw.home / "boxes" / "t1"),
            state_dir=str(d.state),
            socket=str(d.socket),
            workdir=str(tmp_path),
            watch=(str(d.watch),),
            durable=d.durable.as_uri(),
            run_id="default",
        )
    )
    state.close()
    return bw


def test_reap_ends_a_vram_zombie_and_refuses_what_no_reading_lists(tmp_path: Path) -> None:
    with started(["sleep", "600"]) as victim, started(["sleep", "600"]) as other:
        probe = record(tmp_path / "nvml.json", [victim.pid])
        with running(tmp_path / "box", gpu_probe=probe) as d:
            bw = cli_for(tmp_path, d)
            r = bw("reap", "t1", "--pid", str(victim.pid), "--grace", "5", "--json")
            assert r.returncode == 0, r.stderr
            doc = json.loads(r.stdout)
            assert doc["box"] == "t1" and doc["pid"] == victim.pid and doc["gone"] is True
            assert "sent SIGTERM" in doc["detail"]
            assert victim.wait(timeout=30) == -signal.SIGTERM

            r = bw("reap", "t1", "--pid", str(other.pid))
            assert r.returncode == 1
            assert "holds no GPU memory" in " ".join(r.stderr.split()), r.stderr
            assert pid_alive(other.pid)


def test_reap_options_are_checked_before_any_box_is_reached(tmp_path: Path) -> None:
    bw = Bw(tmp_path / "home", tmp_path)
    for args in (["reap", "t1"], ["reap", "t1", "--pid", "0"], ["reap", "t1", "--pid", "x"]):
        r = bw(*args)
        assert r.returncode == 2, (args, r.stderr)
    r = bw("reap", "t1", "--pid", "1234", "--grace", "0")
    assert r.returncode == 2 and "--grace" in r.stderr
    r = bw("reap", "ghost", "--pid", "1234")
    assert r.returncode == 1 and "no box named 'ghost'" in r.stderr
