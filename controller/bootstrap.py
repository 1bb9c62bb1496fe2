"""Bootstrap: start the sidecar for a box on the local profile, idempotently, and wait for its Hello.

The sidecar runs detached in its own session (it must outlive this CLI), with a pid file and its
log in the box's directory. A second `up` with the same version leaves a running sidecar alone; a
sidecar of another version is shut down and restarted. (Remote boxes reach the same code through SSH
in a later version; the config travels as a SidecarConfig message either way.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import blake3
from boxwarden_pb.v1 import sidecar_pb2 as pb
from google.protobuf import json_format

from controller import __version__
from controller.client import SidecarClient
from controller.errors import ControllerError, SidecarUnreachable, VersionMismatch
from controller.manifest import atomic_write_json
from controller.reach import target
from controller.state import Box

logger = logging.getLogger(__name__)

MAX_SOCKET_PATH = 100
START_DEADLINE_S = 30.0
STOP_DEADLINE_S = 15.0


def socket_path_for(box_dir: Path) -> Path:
    """The sidecar's socket; a short path under /tmp when the natural one is too long for sun_path."""
    natural = box_dir / "sidecar" / "sidecar.sock"
    if len(str(natural).encode()) <= MAX_SOCKET_PATH:
        return natural
    tag = blake3.blake3(str(box_dir).encode()).hexdigest()[:16]
    return Path(f"/tmp/boxwarden-{os.getuid()}") / f"{tag}.sock"


def config_for(box: Box) -> pb.SidecarConfig:
    return pb.SidecarConfig(
        box_name=box.name,
        profile=box.profile,
        state_dir=box.state_dir,
        socket_path=box.socket,
        watch_dirs=list(box.watch),
        durable_url=box.durable,
        run_id=box.run_id,
        workdir=box.workdir,
        exclude_patterns=list(box.exclude),
    )


@dataclass(frozen=True)
class UpResult:
    hello: pb.HelloResponse
    started: bool  # False: a sidecar of this version was already running and was left alone
    note: str = ""


async def _hello(box: Box, timeout_s: float) -> pb.HelloResponse | None:
    """Hello without the version check; None if nothing answers."""
    if not Path(box.socket).exists():
        return None
    async with SidecarClient(target(box)) as c:
        try:
            return await c.hello(timeout_s=timeout_s, check_version=False)
        except SidecarUnreachable:
            return None


async def up(box: Box) -> UpResult:
    box_dir = Path(box.box_dir)
    running = await _hello(box, timeout_s=2.0)
    if running is not None and running.version == __version__:
        note = ""
        if list(running.watch_dirs) != list(box.watch) or running.durable_url != box.durable:
            note = "the running sidecar keeps its own watch dirs and durable URL; `down` it to change them"
        return UpResult(hello=running, started=False, note=note)
    if running is not None:
        logger.info("sidecar runs version %s, restarting with %s", running.version, __version__)
        async with SidecarClient(target(box)) as c:
            await c.shutdown()
        await wait_gone(box, running.pid, deadline_s=15.0)

    box_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    cfg_path = box_dir / "sidecar.json"
    atomic_write_json(cfg_path, json_format.MessageToDict(config_for(box)))
    log = open(box_dir / "sidecar.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "--config", str(cfg_path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        log.close()
    try:
        return await _started(box, proc)
    except BaseException:
        # An `up` that fails (or is interrupted) leaves no sidecar of its own running: the box's
        # record, and what an earlier teardown recorded, still describe it.
        _stop_child(proc)
        raise


async def _started(box: Box, proc: subprocess.Popen[bytes]) -> UpResult:
    box_dir = Path(box.box_dir)
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            tail = _tail(box_dir / "sidecar.log")
            raise ControllerError(
                f"the sidecar exited with status {code} while starting; its log says:\n{tail}"
            )
        hello = await _hello(box, timeout_s=1.0)
        if hello is not None:
            if hello.version != __version__:
                raise VersionMismatch(f"the sidecar that answered runs {hello.version}, not {__version__}")
            return UpResult(hello=hello, started=True)
        await asyncio.sleep(0.1)
    tail = _tail(box_dir / "sidecar.log")
    raise SidecarUnreachable(
        f"the sidecar did not answer within {START_DEADLINE_S:.0f}s; its log says:\n{tail}"
    )


def _stop_child(proc: subprocess.Popen[bytes]) -> None:
    """Stop the sidecar this `up` started and wait for its end (SIGTERM, then SIGKILL)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours is dead for every purpose here.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def wait_gone(box: Box, pid: int, *, deadline_s: float) -> bool:
    """Wait until the sidecar process is gone AND its socket no longer answers."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not pid_alive(pid) and await _hello(box, timeout_s=0.5) is None:
            return True
        await asyncio.sleep(0.1)
    return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(cannot read {path}: {e.strerror})"
