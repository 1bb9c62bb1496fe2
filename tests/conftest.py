"""Shared fixtures: the real CLI in a subprocess against real sidecars, each test with its own
$BOXWARDEN_HOME; helpers that await a condition with a deadline (never a bare sleep)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from tests.s3server import s3  # noqa: F401
from tests.sshbox import ssh_box, sshd  # noqa: F401

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-gpu", action="store_true", help="run tests that need a real NVIDIA GPU")


def pytest_configure(config: pytest.Config) -> None:
    """Keep compiled bytecode, whatever PYTHONDONTWRITEBYTECODE says: pytest then caches the test
    modules it rewrites for its assertions (each xdist worker collects every module again), and the
    project's own packages are byte-compiled once, in the main process, before any test. The tests
    start the CLI, local sidecars and `sidecar.launch` in a thousand fresh processes, each importing
    dozens of these modules; without the .pyc files each would compile them from source again. A
    stale .pyc is never used (Python checks the source's mtime and size), so this only saves time;
    the files go to the usual, git-ignored __pycache__ directories."""
    sys.dont_write_bytecode = False
    if hasattr(config, "workerinput"):  # an xdist worker: the main process compiled already
        return
    import compileall

    for package in (REPO / "controller", REPO / "sidecar", REPO / "proto" / "boxwarden_pb"):
        compileall.compile_dir(package, quiet=2)


# The order tests are handed out in (xdist hands them out in collection order, so each worker runs
# its share in this order too), sorted once the session has collected them:
#
# 1. tests/sidecar first. Its job tests run a JobSupervisor inside the test process, and that counts
#    every child of the process as the job's: the sshd fixture's server, a child of the process that
#    first asks for it and kept for the rest of the session, must not exist yet.
# 2. Then the modules with the longest tests (a shared build, a training run, a box or a sidecar per
#    test), longest first, so that the run does not end with one worker still on a long test while
#    the others have nothing left. Only an order: a name here that no longer exists changes nothing.
# 3. Then every other module, in the usual order.
SLOW_FIRST = (
    "tests/test_packaging.py",
    "tests/test_demo.py",
    "tests/test_train_tiny.py",
    "tests/test_tree_invariant.py",
    "tests/test_remote_e2e.py",
    "tests/test_identity_e2e.py",
    "tests/test_box_gone_e2e.py",
    "tests/test_when_safe_e2e.py",
    "tests/test_fleet_ops_e2e.py",
    "tests/test_fanout_fleet_e2e.py",
    "tests/test_box_trust_e2e.py",
    "tests/test_s3_store.py",
    "tests/controller/test_teardown_resume.py",
    "tests/test_gate_reasons.py",
    "tests/test_review12_e2e.py",
    "tests/controller/test_pull_hardening.py",
    "tests/test_iron_law_e2e.py",
    "tests/test_review7_e2e.py",
    "tests/controller/test_meter_stop.py",
    "tests/test_review4_e2e.py",
    "tests/controller/test_input_hardening.py",
    "tests/controller/test_cli_up.py",
    "tests/controller/test_bulk_pull.py",
)
FIRST_DIR = "tests/sidecar/"


def _run_order(item: pytest.Item) -> tuple[int, int]:
    module = item.nodeid.split("::")[0]
    if module.startswith(FIRST_DIR):
        return (0, 0)
    return (1, SLOW_FIRST.index(module) if module in SLOW_FIRST else len(SLOW_FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_run_order)  # stable: within a module, the usual order
    if config.getoption("--run-gpu"):
        return
    skip = pytest.mark.skip(reason="needs a real GPU: run with --run-gpu on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def session_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """The directory `name` of this test session, shared by its xdist workers (their temp dirs are
    siblings in the session's own dir)."""
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    d.mkdir(exist_ok=True)
    return d


@contextlib.contextmanager
def exclusive(lock: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on the file `lock` (made if missing) for the block; the xdist workers
    are processes, so it serializes them. With `wait=False` the block gets False at once when another
    holds it, True when it is ours."""
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Path:
    """The directory `name` of this test session, filled by `build(dir)` once for the session: the
    first xdist worker to ask builds it while any other waits for it, then they all read the same one
    (a module fixture would build it again in every worker that runs a test of the module). After a
    build that failed, the next to ask starts again from an empty directory."""
    shared = session_dir(tmp_path_factory, "built-once")
    d, done = shared / name, shared / f"{name}.done"
    with exclusive(shared / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            build(d)
            done.touch()
    return d


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


def save_weights(path: Path, seed: int = 0, size: int = 1000) -> None:
    """A real safetensors checkpoint (one float32 tensor of `size` values and a step in its
    metadata), written the atomic way `save_ckpt` writes. Its load probe reads the header and needs
    no torch: for the tests whose subject is not the torch load probe, where a verify that must
    import torch (two seconds of CPU, forty times a run) buys nothing."""
    data = random.Random(seed).randbytes(4 * size)
    header = {
        "__metadata__": {"step": str(seed)},
        "w": {"dtype": "F32", "shape": [size], "data_offsets": [0, len(data)]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the reference writer pads the header to 8 bytes
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
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
            # A home of its own: the boxes on this machine name their state roots there
            # (~/.boxwarden/roots), and one test's boxes are not another's neighbours.
            "HOME": str(home.with_name(f"{home.name}-user")),
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

    def record(self, name: str) -> dict[str, Any]:
        """The box's record in the controller state, as `up` wrote it."""
        db = sqlite3.connect(f"file:{self.home / 'state.db'}?mode=ro", uri=True)
        try:
            (row,) = db.execute("SELECT record FROM boxes WHERE name = ?", (name,)).fetchall()
        finally:
            db.close()
        return dict(json.loads(row[0]))

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


@contextlib.contextmanager
def fuse_mount(tmp_path: Path, env: dict[str, str] | None = None) -> Iterator[Path]:
    """tests/cifuse.py mounted on a fresh directory under `tmp_path`, unmounted after."""
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
        env={**os.environ, **(env or {})},
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


@pytest.fixture
def case_insensitive_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a real case-insensitive filesystem (tests/cifuse.py on FUSE), unmounted after."""
    with fuse_mount(tmp_path) as mnt:
        yield mnt
