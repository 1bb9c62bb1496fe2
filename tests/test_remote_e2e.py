"""Remote boxes over a real sshd on 127.0.0.1: each box is a dedicated Unix user whose home is the
box, reached through a Host alias in an ssh_config the controller is pointed at
($BOXWARDEN_SSH_CONFIG). The controller installs the sidecar's venv there from its own wheelhouse,
starts it detached, and drives the whole lifecycle through the SSH link.

The tests whose subject is the bootstrap (up from nothing, no index, --box-index, state on the
durable tier, what is refused) install the venv for real. The others (`remote.up(box, seeded=True)`)
start on a box that already has it: a copy of a venv `up` installed for real earlier in the session
(`VenvTemplate`), under the name `up` looks for (the wheelhouse's digest) and owned by the box user,
so `up` finds it complete and goes straight to starting the sidecar."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from controller.ssh.argv import Destination
from tests.conftest import REPO, Bw, exclusive, session_dir, wait_until
from tests.controller.test_meter_stop import fake_profile
from tests.s3server import SECRET, S3Server, write_credentials
from tests.sshbox import Box, SshBoxFactory

FAKE = REPO / "tests" / "fake_provider.py"


def remote_profile(tmp_path: Path, kind: str = "ssh") -> Path:
    """The fake provider's profile (tests/controller/test_meter_stop.py) as a remote kind, whose
    box home survives the stop and holds the default durable dir."""
    p = fake_profile(tmp_path, watch_tier_path="~")
    text = p.read_text().replace('kind = "local"', f'kind = "{kind}"')
    text = text.replace("survives_destroy = false", "survives_destroy = true\ndurable_default = true")
    p.write_text(text)
    return p


@pytest.fixture(scope="session")
def wheel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One wheelhouse cache for every test (and xdist worker) of the session."""
    return session_dir(tmp_path_factory, "wheelhouse")


_BOX_PLATFORM: list[Any] = []  # the boxes' platform, probed once per process (they share one python3)


def _wheelhouse(box: Box, cache: Path) -> Any:
    """The wheelhouse `up` will use for `box`, built once per session (the first caller builds it,
    any other worker waits for it instead of downloading the same wheels at the same time)."""
    from controller import wheelhouse

    if not _BOX_PLATFORM:
        r = box.run_as_box(["python3", "-c", wheelhouse.PROBE_SCRIPT])
        assert r.returncode == 0, r.stderr
        _BOX_PLATFORM.append(wheelhouse.BoxPlatform.from_probe(json.loads(r.stdout)))
    with exclusive(cache.parent / "wheelhouse.lock"):
        return wheelhouse.build(_BOX_PLATFORM[0], cache)


class VenvTemplate:
    """The sidecar's venv as `up` installed it on a box, kept once per session and wheelhouse
    digest (`<dir>/<digest>`): the first remote `up` that installs one for real leaves a copy here
    (`offer`), and a box about to be seeded gets a copy of it (`seed`). All xdist workers share it;
    the lock serializes the copies, and a seeded `up` that finds no template yet holds the lock
    through its own (real) install, so the others wait for its venv instead of installing their own."""

    def __init__(self, d: Path) -> None:
        self.dir = d
        self.lock = d / ".lock"

    def seed(self, box: Box, digest: str) -> bool:
        """Give `box` the venv `up` would install (~/.boxwarden/venvs/<digest>, the box user's, and
        complete); False when there is no template yet (the caller then installs for real)."""
        src = self.dir / digest
        if not (src / ".complete").exists():
            return False
        if (box.home / ".boxwarden" / "venvs" / digest / ".complete").exists():
            return True  # seeded (or installed) already
        state = box.home / ".boxwarden"
        venvs = state / "venvs"
        for d in (state, venvs):  # as the real install leaves them: the box user's, 0755
            d.mkdir(mode=0o755, exist_ok=True)
            os.chown(d, box.uid, box.gid)
        dest = venvs / digest
        subprocess.run(["cp", "-a", str(src), str(dest)], check=True, capture_output=True)
        # -h: the symlinks themselves (bin/python3 -> /usr/bin/python3), never what they point at.
        subprocess.run(["chown", "-hR", f"{box.uid}:{box.gid}", str(dest)], check=True, capture_output=True)
        r = box.run_as_box([f"{dest}/bin/python", "-c", "import grpc, sidecar"])
        assert r.returncode == 0, f"the seeded venv does not run for {box.user}: {r.stderr}"
        return True

    def offer(self, box: Box) -> None:
        """Keep the venv a real install just left on `box`, if there is no template for it yet."""
        venvs = box.home / ".boxwarden" / "venvs"
        names = os.listdir(venvs) if venvs.is_dir() else []
        found = [venvs / n for n in names if re.fullmatch(r"[0-9a-f]{64}", n)]
        if len(found) != 1 or not (found[0] / ".complete").exists() or (self.dir / found[0].name).exists():
            return
        tmp = self.dir / f".new-{found[0].name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["cp", "-a", str(found[0]), str(tmp)], check=True, capture_output=True)
        subprocess.run(["chown", "-hR", "0:0", str(tmp)], check=True, capture_output=True)
        os.rename(tmp, self.dir / found[0].name)


@pytest.fixture(scope="session")
def venv_template(tmp_path_factory: pytest.TempPathFactory) -> VenvTemplate:
    return VenvTemplate(session_dir(tmp_path_factory, "box-venv"))


class Remote:
    def __init__(
        self, bw: Bw, boxes: SshBoxFactory, tmp_path: Path, wheel_cache: Path, template: VenvTemplate
    ) -> None:
        self.bw, self.boxes, self.tmp = bw, boxes, tmp_path
        self.wheel_cache, self.template = wheel_cache, template
        self.profile = remote_profile(tmp_path)
        bw.env["BOXWARDEN_SSH_CONFIG"] = str(boxes.config)
        bw.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "provider.json")

    def up(self, box: Box, *extra: str, code: int = 0, seeded: bool = False) -> dict[str, Any]:
        """`up --host` of `box`. `seeded`: the box gets the sidecar's venv from the session's
        template first (for tests whose subject is not the bootstrap); without a template yet,
        this `up` installs it for real and its venv becomes the template."""
        if code != 0:
            return self._up(box, extra, code)
        if seeded:
            with self.seeding(box) as seeded_now:
                if not seeded_now:
                    out = self._up(box, extra, code)  # the others wait for this venv
                    self.template.offer(box)
                    return out
            return self._up(box, extra, code)
        _wheelhouse(box, self.wheel_cache)  # (built once per session, before any real install)
        out = self._up(box, extra, code)
        with exclusive(self.template.lock, wait=False) as mine:
            if mine:
                self.template.offer(box)
        return out

    @contextlib.contextmanager
    def seeding(self, box: Box) -> Iterator[bool]:
        """Give `box` the session's venv template (True), or, with none yet, hold the template's
        lock while the caller installs one for real (False) and offers it."""
        digest = _wheelhouse(box, self.wheel_cache).digest
        with exclusive(self.template.lock):
            yield self.template.seed(box, digest)

    def _up(self, box: Box, extra: tuple[str, ...], code: int) -> dict[str, Any]:
        args = ("up", box.alias, "--profile-file", str(self.profile), "--host", box.alias)
        more = ("--instance-id", f"i-{box.alias}", "--watch", "ckpt", *extra)
        self.running(more)
        r = self.bw(*args, *more, "--json", timeout=300)
        assert r.returncode == code, f"up exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return dict(json.loads(r.stdout)) if code == 0 else {"stderr": r.stderr}

    def running(self, args: Sequence[str]) -> None:
        """The instance `up` with these arguments names is one the fake provider lists (created if it
        does not list it yet; one a test created keeps what it was created with)."""
        ids = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--instance-id"]
        state = Path(self.bw.env["FAKE_PROVIDER_STATE"])
        listed = json.loads(state.read_text())["instances"] if state.exists() else {}
        if ids and ids[-1] not in listed:
            self.provider("create", ids[-1])

    def provider(self, *args: str) -> None:
        import subprocess

        subprocess.run([sys.executable, str(FAKE), *args], env=self.bw.env, check=True, capture_output=True)


@pytest.fixture
def remote(
    bw: Bw, ssh_box: SshBoxFactory, tmp_path: Path, wheel_cache: Path, venv_template: VenvTemplate
) -> Iterator[Remote]:
    bw.env["BOXWARDEN_WHEELHOUSE"] = str(wheel_cache)
    r = Remote(bw, ssh_box, tmp_path, wheel_cache, venv_template)
    try:
        yield r
    finally:
        for box in ssh_box.boxes.values():  # the masters this test's controller left persisting
            _exit_master(bw, box)


def _exit_master(bw: Bw, box: Box) -> None:
    import subprocess

    for cm in _control_paths(bw):
        subprocess.run(
            ["ssh", "-F", str(box.config), "-o", f"ControlPath={cm}", "-O", "exit", box.alias],
            capture_output=True,
            timeout=15,
        )


def _control_paths(bw: Bw) -> list[Path]:
    """This controller's ControlMaster sockets (one per box it reached)."""
    from controller.ssh.connector import SshConnector

    out = []
    for name in _names(bw):
        rec = bw.record(name)
        if rec["host"]:
            dest = Destination(rec["host"], tuple(rec["ssh_options"]), rec["ssh_config"])
            out.append(Path(SshConnector(dest, home=bw.home, tag=name).control_path))
    return out


def _names(bw: Bw) -> list[str]:
    import sqlite3

    if not (bw.home / "state.db").exists():
        return []
    db = sqlite3.connect(bw.home / "state.db")
    try:
        return [r[0] for r in db.execute("SELECT name FROM boxes")]
    finally:
        db.close()


def sidecars(box: Box) -> list[int]:
    """The box user's sidecar processes (its ControlMaster's sshd session is not one)."""
    return [p for p in box.processes() if "sidecar" in _cmdline(p)]


def owner_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid in /proc/{pid}/status")


def write_as_box(box: Box, rel: str, data: str) -> None:
    code = "import os,sys; p=os.path.expanduser(sys.argv[1]); open(p,'w').write(sys.argv[2])"
    r = box.run_as_box(["python3", "-c", code, f"~/{rel}", data])
    assert r.returncode == 0, r.stderr


def test_up_from_nothing_then_again_then_after_a_kill(remote: Remote) -> None:
    box = remote.boxes("r1")
    t0 = time.monotonic()
    first = remote.up(box)
    cold = time.monotonic() - t0
    pid = first["pid"]
    assert first["started"] is True and owner_of(pid) == box.uid  # the box user's own process
    venvs = list((box.home / ".boxwarden" / "venvs").iterdir())
    assert len(venvs) == 1 and (venvs[0] / ".complete").exists()
    # The sidecar outlived the SSH session that started it (a new one answers its Hello).
    again = remote.up(box)
    assert again["started"] is False and again["pid"] == pid
    os.kill(pid, 9)
    wait_until(
        lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
        what="the killed sidecar gone",
    )
    third = remote.up(box)
    assert third["started"] is True and third["pid"] != pid and owner_of(third["pid"]) == box.uid
    assert list((box.home / ".boxwarden" / "venvs").iterdir()) == venvs  # the venv was reused
    print(f"cold up {cold:.1f}s")


def test_the_whole_lifecycle_over_ssh(remote: Remote) -> None:
    box = remote.boxes("r2")
    remote.provider("create", "i-r2", "--linger", "2")
    remote.up(box, seeded=True)
    bw = remote.bw
    job = "mkdir -p ckpt && printf 'weights' > ckpt/a.bin && echo saved on $(hostname)"
    r = bw("run", box.alias, "--json", "--", "sh", "-c", job)
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["id"]
    write_as_box(box, "ckpt/b.bin", "more weights")
    a = bw.wait_durable(box.alias, 2, timeout=60)
    assert {c["path"] for c in a["claims"]} == {"a.bin", "b.bin"}
    assert "saved on" in bw.ok("logs", box.alias, "--job", job_id).stdout  # the job's log, over the link
    rows = {r["box"]: r for r in bw.json("status")["boxes"]}
    assert rows[box.alias]["host"] == box.alias and rows[box.alias]["sidecar"]["version"].startswith("0.")
    pulled = bw.cwd / "pulled"
    bw.ok("pull", box.alias, "--to", str(pulled))
    assert (pulled / "a.bin").read_text() == "weights" and (pulled / "b.bin").read_text() == "more weights"
    bw.ok("verify", str(pulled))
    doc = bw.json("down", box.alias, "--confirm", box.alias)
    assert doc["teardown"]["gone"] is True
    assert sorted(doc["teardown"]["deleted"]) == ["a.bin", "b.bin"]
    assert not (box.home / "ckpt" / "a.bin").exists()  # released on the box, after the pull was verified
    assert not box.processes()  # the sidecar stopped, and the ControlMaster closed with the link


def test_option_injection_through_host_is_refused(remote: Remote) -> None:
    box = remote.boxes("r3")
    for host in ("-oProxyCommand=touch /tmp/pwned", "r3 -v", "r3\nx"):
        r = remote.bw("up", "x1", "--profile-file", str(remote.profile), "--host", host, "--watch", "ckpt")
        assert r.returncode == 2 and "is not an SSH destination" in r.stderr, r.stderr
    r = remote.bw(
        "up",
        "x1",
        "--profile-file",
        str(remote.profile),
        "--host",
        box.alias,
        "--ssh-option",
        "ControlPath=/tmp/x",
        "--watch",
        "ckpt",
    )
    assert r.returncode == 2 and "sets ControlPath itself" in r.stderr
    assert not box.processes()  # not even a connection was made


@pytest.mark.parametrize("kind", ["empty", "wrong"])
def test_an_unknown_or_changed_host_key_fails_fast_and_says_what_to_run(remote: Remote, kind: str) -> None:
    box = remote.boxes("r4")
    remote.bw.env["BOXWARDEN_SSH_CONFIG"] = str(box.config_with_known_hosts(kind))
    t0 = time.monotonic()
    r = remote.bw(
        "up",
        box.alias,
        "--profile-file",
        str(remote.profile),
        "--host",
        box.alias,
        "--instance-id",
        "i-4",
        "--watch",
        "ckpt",
        timeout=60,
    )
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    want = "is not known here" if kind == "empty" else "has CHANGED"
    assert want in r.stderr and f"ssh {box.alias}" in r.stderr, r.stderr
    assert took < 15
    assert not sidecars(box)
    assert not (box.home / ".boxwarden").exists()


def test_bootstrap_needs_no_package_index_on_the_box(remote: Remote) -> None:
    box = remote.boxes("r5")
    box.block_index()
    out = remote.up(box)
    assert out["started"] is True and owner_of(out["pid"]) == box.uid


# -- cut tests: the link breaks while events stream and a big file is pulled --------------------------


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _link_pids(bw: Bw, box: Box, cli_pid: int, mode: str) -> list[int]:
    """The ssh processes that carry this box's link: its ControlMaster (master mode), or the
    forward process a CLI command started (tcp mode)."""
    import subprocess

    if mode == "tcp":
        return [c for c in _children(cli_pid) if "-N" in _cmdline(c) and "-L" in _cmdline(c)]
    pids = []
    for cm in _control_paths(bw):
        r = subprocess.run(
            ["ssh", "-F", str(box.config), "-o", f"ControlPath={cm}", "-O", "check", box.alias],
            capture_output=True,
            text=True,
            timeout=15,
        )
        if r.returncode == 0 and "pid=" in r.stderr:
            pids.append(int(r.stderr.split("pid=")[1].split(")")[0]))
    return pids


def _box_seqs(box: Box, name: str) -> list[int]:
    import sqlite3

    ledger = box.home / ".boxwarden" / "boxes" / name / "sidecar" / "ledger.sqlite"
    db = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
    try:
        return [int(r[0]) for r in db.execute("SELECT seq FROM events ORDER BY seq")]
    finally:
        db.close()


def _kept(bw: Bw, name: str) -> list[dict[str, Any]]:
    lines = bw("events", name, "--json").stdout.splitlines()
    return [json.loads(x) for x in lines if x.strip()]


@pytest.mark.parametrize(("mode", "mib"), [("master", 200), ("tcp", 64)])
def test_a_cut_link_loses_no_event_and_no_byte_and_the_gate_waits_for_it(
    remote: Remote, mode: str, mib: int
) -> None:
    import subprocess

    import blake3

    bw = remote.bw
    bw.env["BOXWARDEN_SSH_MODE"] = mode
    box = remote.boxes("c1")
    remote.provider("create", "i-c1", "--linger", "1")
    remote.up(box, seeded=True)
    size = mib << 20
    r = box.run_as_box(
        ["sh", "-c", f"mkdir -p ckpt && head -c {size} /dev/urandom > ckpt/big.bin"], timeout=120
    )
    assert r.returncode == 0, r.stderr
    bw.wait_durable(box.alias, 1, timeout=120)
    want = blake3.blake3((box.home / "ckpt" / "big.bin").read_bytes()).hexdigest()

    log = remote.tmp / "events.jsonl"
    with open(log, "wb") as out:
        follower = subprocess.Popen(
            [sys.executable, "-m", "controller", "events", box.alias, "-f", "--json"],
            cwd=bw.cwd,
            env=bw.env,
            stdout=out,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_until(lambda: "ARTIFACT_DURABLE" in log.read_text(), timeout=60, what="the follower caught up")
        (mine,) = wait_until(lambda: _link_pids(bw, box, follower.pid, mode) or None, what="the link")
        os.kill(mine, 9)  # cut while WatchEvents streams
        write_as_box(box, "ckpt/after-cut.bin", "sealed after the cut")

        pulled = bw.cwd / "pulled"
        puller = subprocess.Popen(
            [sys.executable, "-m", "controller", "pull", box.alias, "--to", str(pulled)],
            cwd=bw.cwd,
            env=bw.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        parts = pulled / ".bw-parts"

        def mid_transfer() -> bool:
            sizes = [p.stat().st_size for p in parts.glob("*.part")] if parts.exists() else []
            return any(0 < s < size for s in sizes)

        wait_until(mid_transfer, timeout=60, what="the pull half way")
        for pid in _link_pids(bw, box, puller.pid, mode):
            os.kill(pid, 9)  # cut while the big file is pulled
        out, err = puller.communicate(timeout=300)
        assert puller.returncode == 0, err.decode()
        assert blake3.blake3((pulled / "big.bin").read_bytes()).hexdigest() == want

        # An outage: the link is cut and the box cannot be reached until it is back.
        config = Path(box.config)
        good = config.read_text()
        config.write_text(good.replace(f"Port {box.port}", "Port 1"))
        for pid in _link_pids(bw, box, follower.pid, mode):
            os.kill(pid, 9)
        t0 = time.monotonic()
        row = {x["box"]: x for x in bw.json("status")["boxes"]}[box.alias]
        assert row["unreachable"] is True and row["error"] and time.monotonic() - t0 < 30
        bw.ok("verify", str(pulled))
        r = bw("down", box.alias, "--confirm", box.alias, "--json")
        assert r.returncode == 3 and "SIDECAR_UNREACHABLE" in r.stdout + r.stderr
        config.write_text(good)

        # Back: the follower catches up by itself; the journal kept has every event once, in order.
        wait_until(lambda: "after-cut.bin" in log.read_text(), timeout=90, what="the follower back")
        bw.ok("pull", box.alias, "--to", str(pulled))
        bw.ok("verify", str(pulled))
    finally:
        follower.terminate()
        follower.wait(timeout=30)
    seqs = [e["seq"] for e in _kept(bw, box.alias)]
    box_seqs = _box_seqs(box, box.alias)
    assert seqs == sorted(set(seqs)) and seqs == box_seqs[: len(seqs)]
    assert seqs == list(range(1, len(seqs) + 1))  # no gap, no duplicate
    doc = bw.json("down", box.alias, "--confirm", box.alias)
    assert doc["teardown"]["gone"] is True


def test_up_restarts_a_sidecar_of_another_version(remote: Remote) -> None:
    box = remote.boxes("v1")
    first = remote.up(box, seeded=True)
    os.kill(first["pid"], 9)
    wait_until(lambda: not sidecars(box), what="the sidecar gone")
    (venv,) = (box.home / ".boxwarden" / "venvs").iterdir()
    old = venv.parent / "old"
    script = (
        f"cp -a {venv} {old} && sed -i 's/^__version__ = .*/__version__ = \"0.0.9\"/' "
        f"{old}/lib/python3*/site-packages/sidecar/__init__.py"
    )
    assert box.run_as_box(["sh", "-c", script]).returncode == 0
    cfg = box.home / ".boxwarden" / "boxes" / box.alias / "sidecar.json"
    # The one `up` started, as far as its record knows (an older release that `up` started).
    nonce = remote.bw.record(box.alias)["sidecar_nonce"]
    older = box.spawn_as_box([f"{old}/bin/python", "-m", "sidecar", "--config", str(cfg), "--nonce", nonce])
    # Its pid file is written once it listens (the killed one's socket file is still there).
    pid_file = box.home / ".boxwarden" / "boxes" / box.alias / "sidecar" / "sidecar.pid"
    wait_until(lambda: pid_file.read_text().strip() != str(first["pid"]), what="the old sidecar listening")
    again = remote.up(box)
    assert again["started"] is True and again["pid"] != older.pid
    assert older.wait(timeout=30) == 0  # it was shut down in order, not killed
    rows = {r["box"]: r for r in remote.bw.json("status")["boxes"]}
    assert rows[box.alias]["sidecar"] == {"version": "0.1.0", "pid": again["pid"]}


def test_one_status_shows_two_remote_boxes_and_a_local_one(remote: Remote) -> None:
    a, b = remote.boxes("m1"), remote.boxes("m2")
    remote.up(a, seeded=True)
    remote.up(b, seeded=True)
    remote.bw.up("here")
    rows = {r["box"]: r for r in remote.bw.json("status")["boxes"]}
    assert set(rows) == {"m1", "m2", "here"}
    assert rows["m1"]["host"] == "m1" and rows["m2"]["host"] == "m2" and rows["here"]["host"] is None
    for row in rows.values():
        assert row["sidecar"]["version"] == "0.1.0", row


def test_a_read_only_home_or_no_python_is_refused_with_the_fix(remote: Remote) -> None:
    box = remote.boxes("ro1")
    os.chmod(box.home, 0o555)
    try:
        r = remote.up(box, code=1)
    finally:
        os.chmod(box.home, 0o755)
    assert "is not writable" in r["stderr"] and not sidecars(box)
    box.write_file(".bashrc", "export PATH=/nonexistent\n")
    r = remote.up(box, code=1)
    assert "has no python3 on its PATH" in r["stderr"] and "Python 3.9 or newer" in r["stderr"]
    assert not (box.home / ".boxwarden").exists()


def test_box_index_lets_the_box_fetch_the_dependencies_itself(remote: Remote, wheel_cache: Path) -> None:
    import shutil

    from controller import wheelhouse

    other = remote.boxes("bi2")
    probe = json.loads(other.ssh(["python3", "-c", wheelhouse.PROBE_SCRIPT]).stdout)
    house = wheelhouse.build(wheelhouse.BoxPlatform.from_probe(probe), wheel_cache).dir  # the box's closure
    index = other.sshd.dir / "index"
    for wheel in house.glob("*.whl"):
        project = wheel.name.split("-")[0].lower().replace("_", "-")
        if project == "boxwarden-sidecar":
            continue
        (index / project).mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, index / project / wheel.name)
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in (index / project).glob("*.whl"))
        (index / project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    for d in [index, *index.iterdir(), *index.rglob("*")]:
        d.chmod(0o755 if d.is_dir() else 0o644)
    out = remote.up(other, "--box-index", index.as_uri())
    assert out["started"] is True and owner_of(out["pid"]) == other.uid
    (venv,) = (other.home / ".boxwarden" / "venvs").iterdir()
    assert venv.name.startswith("index-")
    for bad in ("https://user:secret@example.com/simple", "ftp://x/simple", "not a url"):
        r = remote.bw(
            "up",
            "x9",
            "--profile-file",
            str(remote.profile),
            "--host",
            other.alias,
            "--box-index",
            bad,
            "--watch",
            "ckpt",
        )
        assert r.returncode == 2 and "--box-index" in r.stderr, r.stderr
        assert "secret" not in r.stderr


def test_state_on_durable_keeps_ledger_and_venv_on_the_durable_tier(remote: Remote) -> None:
    box = remote.boxes("sd1")
    remote.profile.write_text(remote.profile.read_text().replace('path = "~"', 'path = "~/persist"'))
    assert box.run_as_box(["mkdir", "-p", str(box.home / "persist")]).returncode == 0
    first = remote.up(box, "--state-on-durable")
    persist = box.home / "persist" / ".boxwarden"
    assert (persist / "boxes" / "sd1" / "sidecar" / "ledger.sqlite").exists()
    assert [v for v in (persist / "venvs").iterdir() if (v / ".complete").exists()]
    assert not (box.home / ".boxwarden" / "venvs").exists()  # nothing of it on the box's own disk
    # Named by a digest of the box's whole state path, never a cut of its name (two boxes never share
    # one); its lock beside it.
    (sock,) = (box.home / ".boxwarden" / "s").glob("*.sock")
    assert re.fullmatch(r"[0-9a-f]{32}\.sock", sock.name) and sock.with_name(sock.name + ".lock").exists()
    again = remote.up(box)  # the box remembers where its state lives
    assert again["started"] is False and again["pid"] == first["pid"]
    r = remote.bw("up", "sd2", "--profile", "local", "--state-on-durable", "--watch", "ckpt")
    assert r.returncode == 2 and "--state-on-durable goes with --host" in r.stderr


def test_a_remote_box_proves_its_copies_in_a_bucket_with_credentials_kept_private(
    remote: Remote, s3: S3Server, tmp_path: Path
) -> None:
    box = remote.boxes("s1")
    bucket = s3.bucket()
    creds = write_credentials(tmp_path / "creds")
    # A venv with the s3 extra (boto3): installed for real from a wheelhouse that holds it.
    remote.up(box, "--durable", s3.url(bucket, "ckpts"), "--durable-credentials", str(creds))
    write_as_box(box, "ckpt/a.bin", "weights")
    (claim,) = remote.bw.wait_durable(box.alias, 1, timeout=60)["claims"]
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"ckpts/{box.alias}/")["Contents"]
    (obj,) = [o for o in listed if "/.boxwarden-" not in o["Key"]]  # not the store's id and owner
    assert obj["Key"].endswith("/a.bin") and claim["path"] == "a.bin"
    assert s3.client().get_object(Bucket=bucket, Key=obj["Key"])["Body"].read() == b"weights"
    on_box = box.home / ".boxwarden" / "boxes" / box.alias / "sidecar" / "durable-credentials"
    st = on_box.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (box.uid, 0o600)
    for p in (box.home / ".boxwarden").rglob("*"):  # config, logs, ledger: never the secret
        if p.is_file() and not p.is_symlink() and p != on_box and "venvs" not in p.parts:
            assert SECRET.encode() not in p.read_bytes(), p
    pulled = remote.bw.cwd / "pulled"
    remote.bw.ok("pull", box.alias, "--to", str(pulled))
    remote.bw.ok("verify", str(pulled))
    doc = remote.bw.json("down", box.alias, "--confirm", box.alias)
    assert doc["allowed"] is True and doc["teardown"]["deleted"] == ["a.bin"]
    assert not (box.home / "ckpt" / "a.bin").exists()  # released: its copy is proven in the bucket
    assert not on_box.exists()  # the credentials left the box with its sidecar
