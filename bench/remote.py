"""Figures: a remote box over a real sshd on 127.0.0.1 (a dedicated Unix user whose home is the box,
as the tests make it; needs root).

- `remote-pull`: `boxwarden pull` of a `size`-byte checkpoint over the box's SSH master (its bytes
  come over an ssh session straight into the part file, then are hashed and fsynced before the
  file is put in place), vs `rsync -e ssh` with the same cipher followed by `b3sum` of the
  result (throughput, target ≥ 1.0×). Both sides start a fresh ssh connection and a fresh
  destination each run.
- `remote-up`: `boxwarden up` of a box whose venv exists (sidecar stopped, no ControlMaster left)
  until Hello, vs the target of 3 s (a fixed baseline: `ssh BOX true`, one login, is shown beside
  it). The cold bootstrap from an empty box is reported in the notes (its wheelhouse is built
  afresh, downloading from PyPI, unless $BOXWARDEN_WHEELHOUSE holds one).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import (
    CODE_PATH,
    REPO,
    Context,
    FigureResult,
    Side,
    Timing,
    clock,
    interleaved,
    quiesce,
    remove,
    run_quiet,
)

logger = logging.getLogger(__name__)

KEY = "remote-pull"
TITLE = "pull over the SSH link, hashed on receipt"
TARGET = 1.0
UP_KEY = "remote-up"
UP_TITLE = "up of a box whose venv exists, to Hello"
UP_TARGET_S = 3.0
CIPHER = "aes128-gcm@openssh.com"
NAME = "bench"

PROFILE = """
name = "bench-ssh"
kind = "ssh"
description = "A box on this machine reached over ssh, for the bench."
verified = "2026-12-01"

[meter_stop]
verb = "nothing"
irreversible = false
mode = "manual"
manual = "Nothing bills: this box is a local user."

[detach]
primitive = "setsid"

[spot]
available = false
grace_s = 0
signal = ""

[[storage]]
name = "home"
path = "~"
survives_stop = true
survives_destroy = true
durable_default = true
"""


@dataclass
class Rig:
    env: dict[str, str]
    box: Any  # tests.sshbox.Box (the tests' box user)
    config: Path
    profile: Path
    home: Path

    def cli(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "controller", *args],
            env=self.env, capture_output=True, text=True, timeout=timeout, check=False, cwd="/",
        )  # fmt: skip

    def ok(self, *args: str) -> str:
        r = self.cli(*args)
        if r.returncode != 0:
            raise RuntimeError(f"boxwarden {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
        return r.stdout


@contextmanager
def rig(ctx: Context) -> Iterator[Rig]:
    sys.path.insert(0, str(REPO))
    from tests.sshbox import SshBoxFactory, running_sshd

    with running_sshd() as server:
        boxes = SshBoxFactory(server)
        try:
            box = boxes(NAME)
            home = Path(tempfile.mkdtemp(prefix="bw-bench-home-", dir=ctx.work_dir))
            profile = home / "bench-ssh.toml"
            profile.write_text(PROFILE)
            env = {
                **os.environ,
                "BOXWARDEN_HOME": str(home),
                "BOXWARDEN_SSH_CONFIG": str(boxes.config),
                "PYTHONPATH": CODE_PATH,
            }
            yield Rig(env, box, boxes.config, profile, home)
        finally:
            problems = boxes.close()
            if problems:
                logger.warning("bench box teardown: %s", "; ".join(problems))


def _up(r: Rig) -> dict[str, Any]:
    args = ["up", NAME, "--profile-file", str(r.profile), "--host", NAME]
    args += ["--ssh-option", f"Ciphers={CIPHER}", "--watch", "ckpt", "--json"]
    return dict(json.loads(r.ok(*args)))


def _exit_master(r: Rig) -> None:
    from controller.ssh.argv import Destination
    from controller.ssh.connector import SshConnector

    cm = SshConnector(Destination(NAME), home=r.home, tag=NAME).control_path
    subprocess.run(["ssh", "-F", str(r.config), "-o", f"ControlPath={cm}", "-O", "exit", NAME],
                   capture_output=True, timeout=15, check=False)  # fmt: skip


def _stop_sidecar(r: Rig, pid: int) -> None:
    os.kill(pid, 15)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def run(ctx: Context) -> FigureResult:
    with rig(ctx) as r:
        t0 = clock()
        first = _up(r)
        cold = clock() - t0
        box = r.box
        home: Path = box.home
        (home / "ckpt").mkdir(exist_ok=True)
        dst_src = home / "ckpt" / "big.bin"
        shutil.copyfile(ctx.source_file(), dst_src)
        os.chown(dst_src, box.uid, box.gid)
        _wait_durable(r)
        want = run_quiet(["b3sum", "--no-names", str(ctx.source_file())]).split()[0]
        pulled = ctx.work_dir / "pulled"
        rsynced = ctx.work_dir / "rsynced"

        def ours() -> Timing:
            shutil.rmtree(pulled, ignore_errors=True)
            _exit_master(r)
            quiesce()
            t = clock()
            r.ok("pull", NAME, "--to", str(pulled))
            took = clock() - t
            got = run_quiet(["b3sum", "--no-names", str(pulled / "big.bin")]).split()[0]
            if got != want:
                raise RuntimeError(f"{KEY}: the pulled file hashes {got}, not {want}")
            return Timing(took)

        def baseline() -> Timing:
            shutil.rmtree(rsynced, ignore_errors=True)
            rsynced.mkdir()
            quiesce()
            t = clock()
            ssh = f"ssh -F {r.config} -o Ciphers={CIPHER}"
            run_quiet(["rsync", "-a", "-e", ssh, f"{NAME}:ckpt/big.bin", f"{rsynced}/"])
            got = run_quiet(["b3sum", "--no-names", str(rsynced / "big.bin")]).split()[0]
            took = clock() - t
            if got != want:
                raise RuntimeError(f"{KEY}: rsync's copy hashes {got}, not {want}")
            return Timing(took)

        o = Side("boxwarden pull (bulk over the SSH session, hashed before it is kept, fsynced)")
        b = Side(f"rsync -e 'ssh -c {CIPHER}' && b3sum")
        try:
            interleaved(ctx.runs, ours, baseline, o, b)
            up_runs = _warm_ups(r, int(first["pid"]), ctx.runs)
        finally:
            shutil.rmtree(pulled, ignore_errors=True)
            shutil.rmtree(rsynced, ignore_errors=True)
            remove(dst_src)
            _exit_master(r)
        res = FigureResult(KEY, TITLE, o, b, "throughput", TARGET, ctx.size)
        cached = "built afresh"
        if os.environ.get("BOXWARDEN_WHEELHOUSE"):
            cached = "cached in $BOXWARDEN_WHEELHOUSE"
        res.notes.append(f"cold bootstrap from an empty box (wheelhouse {cached}): {cold:.2f} s")
        med = sorted(up_runs)[len(up_runs) // 2]
        res.notes.append(
            f"{UP_KEY}: up of a box whose venv exists, sidecar stopped, no ControlMaster, to Hello: median "
            f"{med:.2f} s of {', '.join(f'{x:.2f}' for x in up_runs)} (target ≤ {UP_TARGET_S:g} s: "
            f"{'PASS' if med <= UP_TARGET_S else 'FAIL'})"
        )
        return res


def _wait_durable(r: Rig) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        claims = json.loads(r.ok("artifacts", NAME, "--json")).get("claims", [])
        if claims and all(c.get("durable") for c in claims):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{KEY}: the checkpoint did not become durable within 300 s")


def _warm_ups(r: Rig, pid: int, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        _stop_sidecar(r, pid)
        _exit_master(r)
        t = clock()
        pid = int(_up(r)["pid"])
        out.append(clock() - t)
    _stop_sidecar(r, pid)
    return out
