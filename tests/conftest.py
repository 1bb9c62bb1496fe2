"""Shared fixtures: the real CLI in a subprocess against real sidecars, each test with its own
$BOXWARDEN_HOME; helpers that await a condition with a deadline (never a bare sleep)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from tests.sshbox import ssh_box, sshd  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-gpu", action="store_true", help="run tests that need a real NVIDIA GPU")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-gpu"):
        return
    skip = pytest.mark.skip(reason="needs a real GPU: run with --run-gpu on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def wait_until(pred: Callable[[], Any], *, timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `pred` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def tagged_pids(tags: set[bytes]) -> list[int]:
    """PIDs whose initial environment holds one of `tags` (an exact NAME=value entry)."""
    if not tags:
        return []
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if tags.intersection(env):
            out.append(int(entry))
    return out


def save_ckpt(path: Path, seed: int = 0, size: int = 1000) -> None:
    """A real torch checkpoint, written the atomic way a careful trainer does (tmp → fsync → rename)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    obj = {"model_state_dict": {"w": torch.randn(size, generator=g)}, "step": seed}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Bw:
    """Runs the real `boxwarden` CLI in a subprocess with its own state home."""

    def __init__(self, home: Path, cwd: Path) -> None:
        self.home = home
        self.cwd = cwd
        self.env = {
            **os.environ,
            "BOXWARDEN_HOME": str(home),
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")]),
            "COLUMNS": "200",
        }

    def __call__(
        self, *args: str, timeout: float = 120, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "controller", *args],
            cwd=self.cwd,
            env=self.env,
            input=stdin if stdin is not None else "",
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def spawn(self, *args: str) -> subprocess.Popen[bytes]:
        """Start the CLI in the background (no stdin, output discarded); the caller waits for it."""
        return subprocess.Popen(
            [sys.executable, "-m", "controller", *args],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def ok(self, *args: str) -> subprocess.CompletedProcess[str]:
        r = self(*args)
        assert r.returncode == 0, f"boxwarden {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return r

    def json(self, *args: str, code: int = 0) -> dict[str, Any]:
        r = self(*args, "--json")
        assert r.returncode == code, (
            f"boxwarden {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        )
        return dict(json.loads(r.stdout))

    def up(self, name: str, *extra: str, watch: str = "ckpt") -> dict[str, Path]:
        profile = () if "--profile-file" in extra else ("--profile", "local")
        self.ok("up", name, *profile, "--workdir", str(self.cwd), "--watch", watch, *extra)
        box_dir = self.home / "boxes" / name
        # Each run of each box keeps its durable copies in its own corner: <url>/<box>/<run id>.
        base = box_dir / "durable"
        if "--durable" in extra:
            base = Path(unquote(urlsplit(extra[extra.index("--durable") + 1]).path))
        (durable,) = (base / name).iterdir()
        return {"watch": self.cwd / watch, "box_dir": box_dir, "durable": durable}

    def artifacts(self, name: str) -> dict[str, Any]:
        return self.json("artifacts", name)

    def wait_durable(
        self, name: str, count: int, timeout: float = 60, *, pending_ok: bool = False
    ) -> dict[str, Any]:
        """Until the box has exactly `count` claims, all durable, and (unless `pending_ok`: for
        entries that stay pending by design) nothing else in its watched dirs."""

        def settled() -> dict[str, Any] | None:
            a = self.artifacts(name)
            claims = a.get("claims", [])
            calm = pending_ok or not a.get("pending")
            if len(claims) == count and all(c.get("durable") for c in claims) and calm:
                return a
            return None

        return dict(wait_until(settled, timeout=timeout, what=f"{count} durable claims on {name}"))

    def sidecar_pids(self) -> list[int]:
        pids = []
        for pid_file in self.home.glob("boxes/*/sidecar/sidecar.pid"):
            with contextlib.suppress(ValueError, OSError):
                pids.append(int(pid_file.read_text().strip()))
        return pids

    def job_pids(self) -> list[int]:
        pids = []
        for ledger in self.home.glob("boxes/*/sidecar/ledger.sqlite"):
            try:
                db = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
                for (record,) in db.execute("SELECT record FROM jobs"):
                    job = json.loads(record)
                    if job["state"] == "running":
                        pids.append(int(job["pgid"]))
                db.close()
            except sqlite3.Error:
                continue
        return pids

    def job_ids(self) -> set[str]:
        ids: set[str] = set()
        for ledger in self.home.glob("boxes/*/sidecar/ledger.sqlite"):
            try:
                db = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)
                ids.update(r[0] for r in db.execute("SELECT id FROM jobs"))
                db.close()
            except sqlite3.Error:
                continue
        return ids

    def cleanup(self) -> None:
        """Stop what these tests started, by PID: sidecars (SIGTERM, then SIGKILL), their jobs' groups,
        and any process of those jobs that escaped its group (found by its BOXWARDEN_JOB_ID tag)."""
        for pgid in self.job_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        tags = {f"BOXWARDEN_JOB_ID={i}".encode() for i in self.job_ids()}
        for pid in tagged_pids(tags):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in self.sidecar_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def bw(tmp_path: Path) -> Iterator[Bw]:
    work = tmp_path / "work"
    work.mkdir()
    b = Bw(tmp_path / "home", work)
    try:
        yield b
    finally:
        b.cleanup()


def children_of(parent: int, *, zombies: bool = False) -> list[int]:
    """The live children of `parent` (or, with `zombies`, its children that are zombies)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(ppid) == parent and (state in ("Z", "X")) == zombies:
            found.append(int(entry.name))
    return found


@pytest.fixture
def case_insensitive_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a real case-insensitive filesystem (tests/cifuse.py on FUSE), unmounted after."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine: a FUSE filesystem cannot be mounted")
    backing, mnt = tmp_path / "ci-backing", tmp_path / "ci-mount"
    backing.mkdir()
    mnt.mkdir()
    log = open(tmp_path / "cifuse.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "cifuse.py"), str(backing), str(mnt)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        wait_until(lambda: os.path.ismount(mnt) or proc.poll() is not None, what="the FUSE mount")
        assert proc.poll() is None, (tmp_path / "cifuse.log").read_text()
        yield mnt
    finally:
        if os.path.ismount(mnt):
            subprocess.run(["umount", str(mnt)], check=False)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
