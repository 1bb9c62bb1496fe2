"""The ssh-box fixtures (tests/sshbox.py) give a real sshd and real users: what the controller's
transport tests rely on holds here, through the system `ssh` client."""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import pid_alive, wait_until
from tests.sshbox import BLOCKED_INDEX, Box, SshBoxFactory, Sshd, uid_pids

ECHO_SERVER = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen(8)
while True:
    c, _ = s.accept()
    with c:
        data = c.recv(65536)
        c.sendall(f"{os.getuid()}:".encode() + data)
"""


def ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, f"rc {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r.stdout.strip()


def test_sshd_listens_on_loopback_with_the_expected_host_key(sshd: Sshd) -> None:
    assert pid_alive(sshd.pid)
    assert f"Server listening on 127.0.0.1 port {sshd.port}" in sshd.log_text()
    served = subprocess.run(
        ["ssh-keyscan", "-t", "ed25519", "-p", str(sshd.port), "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert sshd.known_hosts_line().strip() in served.stdout.splitlines()
    assert (sshd.dir.stat().st_mode & 0o777) == 0o755
    assert (sshd.private.stat().st_mode & 0o777) == 0o700


def test_ssh_alias_reaches_the_box_user(ssh_box: SshBoxFactory) -> None:
    box = ssh_box("a")
    assert box.alias == "a" and box.config == ssh_box.config
    assert box.user.startswith("bwt") and len(box.user) == 11
    assert pwd.getpwnam(box.user).pw_uid == box.uid
    assert ok(box.ssh("id -un")) == box.user
    assert ok(box.ssh("id -u; echo $HOME; pwd")).split() == [str(box.uid), str(box.home), str(box.home)]
    cfg = box.config.read_text()
    assert "Host a\n" in cfg and f"User {box.user}\n" in cfg and "StrictHostKeyChecking yes" in cfg
    assert (box.config.parent.stat().st_mode & 0o777) == 0o700


def test_file_made_over_ssh_belongs_to_the_box_user_in_its_home(ssh_box: SshBoxFactory) -> None:
    box = ssh_box()
    ok(box.ssh("mkdir -p run/out && printf hello > run/out/made.txt"))
    made = box.home / "run" / "out" / "made.txt"
    assert made.read_text() == "hello"
    for path in (made, made.parent, made.parent.parent):
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (box.uid, box.gid), path


def test_two_boxes_are_two_users_and_cannot_write_into_each_other(ssh_box: SshBoxFactory) -> None:
    a, b = ssh_box("a"), ssh_box("b")
    assert a.user != b.user and a.uid != b.uid and a.home != b.home
    assert a.config == b.config  # one ssh_config holds both Host entries
    assert ok(a.ssh("id -un")) == a.user
    assert ok(b.ssh("id -un")) == b.user
    r = a.ssh(f"touch {b.home}/intruder")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    assert not (b.home / "intruder").exists()
    r = a.ssh(f"cat {b.home}/.ssh/authorized_keys")
    assert r.returncode != 0 and "Permission denied" in r.stderr
    # Locally too, through run_as_box.
    assert ok(b.run_as_box(["id", "-un"])) == b.user
    assert b.run_as_box(["touch", str(a.home / "intruder")]).returncode != 0


def test_unix_socket_forward_round_trip(ssh_box: SshBoxFactory, tmp_path: Path) -> None:
    box = ssh_box()
    remote = box.home / "echo.sock"
    server = box.spawn_as_box(["/usr/bin/python3", "-c", ECHO_SERVER, str(remote)])
    wait_until(lambda: remote.exists() or server.poll() is not None, timeout=20, what="the echo socket")
    assert server.poll() is None and remote.stat().st_uid == box.uid
    local = tmp_path / "fwd.sock"
    fwd = subprocess.Popen(
        box.ssh_argv("-N", "-o", "ExitOnForwardFailure=yes", "-L", f"{local}:{remote}"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def connected() -> socket.socket | None:
            assert fwd.poll() is None, f"ssh -L exited {fwd.returncode}"
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(local))
            except OSError:
                s.close()
                return None
            return s

        with wait_until(connected, timeout=20, what="the forwarded socket") as s:
            s.settimeout(10)
            s.sendall(b"ping \x00\xff bytes")
            s.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        # The reply comes from the box user's process at the far end.
        assert got == f"{box.uid}:".encode() + b"ping \x00\xff bytes"
    finally:
        fwd.terminate()  # by PID
        try:
            fwd.wait(timeout=10)
        finally:
            assert fwd.stderr is not None
            fwd.stderr.close()
    assert fwd.returncode is not None
    wait_until(lambda: not pid_alive(fwd.pid), timeout=10, what="the ssh -L to exit")


def test_unknown_host_key_fails_fast_in_batch_mode(ssh_box: SshBoxFactory) -> None:
    box = ssh_box()
    cfg = box.config_with_known_hosts("empty")
    t0 = time.monotonic()
    r = box.ssh("id -un", config=cfg, timeout=10)
    took = time.monotonic() - t0
    assert r.returncode == 255, r
    assert "Host key verification failed" in r.stderr, r.stderr
    assert r.stdout == ""
    assert took < 5, f"took {took:.1f}s"


def test_changed_host_key_fails_fast_in_batch_mode(ssh_box: SshBoxFactory) -> None:
    box = ssh_box()
    cfg = box.config_with_known_hosts("wrong")
    t0 = time.monotonic()
    r = box.ssh("id -un", config=cfg, timeout=10)
    took = time.monotonic() - t0
    assert r.returncode == 255, r
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in r.stderr, r.stderr
    assert "Host key verification failed" in r.stderr
    assert r.stdout == ""
    assert took < 5, f"took {took:.1f}s"
    # The same box through a config with the right key still works.
    assert ok(box.ssh("id -un", config=box.config_with_known_hosts("good"))) == box.user


def test_block_index_makes_pip_download_fail_on_the_box(ssh_box: SshBoxFactory) -> None:
    box = ssh_box()
    has_pip = box.run_as_box(["/usr/bin/python3", "-m", "pip", "--version"]).returncode == 0
    box.block_index()
    conf = box.home / ".config" / "pip" / "pip.conf"
    assert f"index-url = {BLOCKED_INDEX}" in conf.read_text()
    for rc in (".bashrc", ".profile"):
        assert f"PIP_INDEX_URL={BLOCKED_INDEX}" in (box.home / rc).read_text()
        assert (box.home / rc).stat().st_uid == box.uid
    assert conf.stat().st_uid == box.uid and conf.parent.parent.stat().st_uid == box.uid
    # A non-interactive ssh command sources ~/.bashrc (Debian's bash does over ssh).
    assert ok(box.ssh("echo $PIP_INDEX_URL")) == BLOCKED_INDEX
    if not has_pip:  # no pip for /usr/bin/python3 on this machine: the config content is all we can check
        return
    assert BLOCKED_INDEX in ok(box.ssh("/usr/bin/python3 -m pip config list"))
    t0 = time.monotonic()
    r = box.ssh("/usr/bin/python3 -m pip download --no-deps -d dl six", timeout=120)
    took = time.monotonic() - t0
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "127.0.0.1" in out or "Connection refused" in out, out
    assert "No matching distribution found for six" in out, out
    assert not any((box.home / "dl").glob("six*"))
    assert took < 60, f"took {took:.1f}s"


def test_box_python_and_venv(ssh_box: SshBoxFactory) -> None:
    box = ssh_box()
    assert ok(box.ssh("python3 -c 'import sys; print(sys.version)'")).startswith("3.11")
    prefix = ok(box.ssh("python3 -m venv --without-pip v && v/bin/python -c 'import sys; print(sys.prefix)'"))
    assert prefix == str(box.home / "v")
    assert (box.home / "v" / "pyvenv.cfg").stat().st_uid == box.uid


def test_teardown_stops_the_users_processes_and_deletes_it(sshd: Sshd, tmp_path: Path) -> None:
    factory = SshBoxFactory(sshd)
    try:
        box: Box = factory("a")
        # A process that outlives its ssh session, and one started locally as the box user.
        detached = int(ok(box.ssh("setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!")))
        local = box.spawn_as_box(["sleep", "600"])
        wait_until(lambda: detached in box.processes(), timeout=10, what="the detached sleep")
        wait_until(lambda: len(box.processes()) >= 2, timeout=10, what="the local sleep")
        user, uid, home = box.user, box.uid, box.home
    finally:
        problems = factory.close()
    assert problems == []
    assert not pid_alive(detached)
    assert local.returncode is not None  # runuser was reaped
    assert uid_pids(uid) == []
    assert subprocess.run(["getent", "passwd", user], capture_output=True).returncode == 2
    assert subprocess.run(["getent", "group", user], capture_output=True).returncode == 2
    assert not home.exists() and not factory.dir.exists()
    assert not os.path.exists(factory.config)
