"""controller.warm: the SSH masters a command will need are started while the CLI loads; on any
doubt, nothing is started. The master is a real ssh login to the sshd fixture."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from controller import warm
from controller.ssh import argv as sshargv
from controller.ssh import master
from controller.state import Box, State
from tests.conftest import pid_alive, wait_until
from tests.sshbox import SshBoxFactory


@pytest.mark.parametrize(
    ("argv", "command", "names"),
    [
        (["pull", "b1", "--to", "x"], "pull", ("b1",)),
        (["-v", "artifacts", "b1", "--json"], "artifacts", ("b1",)),
        (["status"], "status", ()),
        (["status", "a", "b", "--json"], "status", ("a", "b")),
        (["run", "b1", "--cell", "c", "--", "python", "t.py"], "run", ("b1",)),
        (["drain", "b1", "--wait", "--timeout", "60"], "drain", ("b1",)),
        (["pull", "--to", "x", "b1"], "pull", ()),  # a name after an option is not guessed at
        (["up", "b1", "--host", "h"], "", ()),  # up starts its link itself
        (["verify", "pulled"], "", ()),
        ([], "", ()),
    ],
)
def test_the_box_names_a_command_will_reach(argv: list[str], command: str, names: tuple[str, ...]) -> None:
    assert warm.box_names(argv) == (command, names)


def _record(state_home: Path, name: str, **fields: object) -> Box:
    box = Box(
        name=name,
        profile="ssh",
        box_dir=str(state_home / "boxes" / name),
        state_dir="/nowhere/state",
        socket="/nowhere/sidecar.sock",
        workdir="/nowhere",
        watch=("/nowhere/ckpt",),
        durable="file:///nowhere",
        run_id="r1",
        **fields,  # type: ignore[arg-type]
    )
    state = State(state_home)
    try:
        state.put(box)
    finally:
        state.close()
    return box


def test_a_remote_box_s_master_is_up_once_warm_is_done(ssh_box: SshBoxFactory, tmp_path: Path) -> None:
    b = ssh_box("w1")
    home = tmp_path / "home"
    box = _record(home, "w1", host=b.alias, ssh_config=str(ssh_box.config))
    _record(home, "local1")  # a box on this machine: no link to start
    dest = sshargv.Destination(box.host, box.ssh_options, box.ssh_config)
    paths = master.LinkPaths.for_box(home, "w1", dest)
    env = {"BOXWARDEN_HOME": str(home)}
    assert master.master_pid(dest, paths.control) is None

    threads = warm.start(["status"], env)
    assert len(threads) == 1
    for t in threads:
        t.join(timeout=60)
    pid = master.master_pid(dest, paths.control)
    try:
        assert pid is not None and pid_alive(pid)
        assert os.path.exists(paths.local_socket), "started with the forward of the box's socket"
        assert warm.start(["pull", "w1"], env)[0].join(timeout=60) is None
        assert master.master_pid(dest, paths.control) == pid, "a live master is used, not started again"
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not pid_alive(pid), what="the master gone")


@pytest.mark.parametrize("case", ["no-state", "unknown-name", "tcp-mode", "down", "bad-mode"])
def test_on_any_doubt_nothing_starts(ssh_box: SshBoxFactory, tmp_path: Path, case: str) -> None:
    b = ssh_box("w2")
    home = tmp_path / "home"
    env = {"BOXWARDEN_HOME": str(home)}
    if case != "no-state":
        _record(
            home,
            "w2",
            host=b.alias,
            ssh_config=str(ssh_box.config),
            status="down" if case == "down" else "up",
        )
    if case == "tcp-mode":
        env["BOXWARDEN_SSH_MODE"] = "tcp"
    if case == "bad-mode":
        env["BOXWARDEN_SSH_MODE"] = "carrier-pigeon"
    name = "other" if case == "unknown-name" else "w2"
    assert warm.start(["pull", name], env) == []  # a bad mode is the command's to report
    assert not (home / "state.db").exists() or case != "no-state"
    dest = sshargv.Destination(b.alias, (), str(ssh_box.config))
    assert master.master_pid(dest, master.LinkPaths.for_box(home, "w2", dest).control) is None
