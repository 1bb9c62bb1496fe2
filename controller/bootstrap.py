"""Bootstrap: start the sidecar of a box, idempotently, and wait for its Hello.

The box-side half (`python -m sidecar.launch start`, run through the box's connector) creates the
watched and durable dirs, checks the durable dir, writes the config (0600) and starts the sidecar
detached in its own session (it must outlive this CLI and the SSH session that started it), unless
a sidecar already holds the box's state dir. A second `up` with the same version leaves a running
sidecar alone; a sidecar of another version is shut down and restarted; a dead one is restarted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
from boxwarden_pb.v1 import sidecar_pb2 as pb
from google.protobuf import json_format

from controller import __version__
from controller.client import SidecarClient
from controller.connector import Connector, launch
from controller.durable import CREDENTIALS_NAME
from controller.errors import ControllerError, SidecarUnreachable, VersionMismatch
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
        durable_credentials_file=f"{box.state_dir}/{CREDENTIALS_NAME}" if box.durable_credentials else "",
        keep=box.keep,
        drain_grace_s=box.drain_grace_s,
        push_rate_bytes_s=box.push_rate,
        stall_s=box.stall_s,
        step_regex=box.step_regex,
        loss_regex=box.loss_regex,
        memory_high_percent=box.memory_high_percent,
        metrics_port=box.metrics_port,
    )


@dataclass(frozen=True)
class UpResult:
    hello: pb.HelloResponse
    started: bool  # False: a sidecar of this version was already running and was left alone
    note: str = ""
    findings: list[dict[str, str]] = field(default_factory=list)  # the box-side checks' findings


async def _hello(conn: Connector, timeout_s: float) -> pb.HelloResponse | None:
    """Hello without the version check; None if nothing answers."""
    try:
        target = await conn.target()
    except SidecarUnreachable:
        return None
    async with SidecarClient(target) as c:
        try:
            return await c.hello(timeout_s=timeout_s, check_version=False)
        except SidecarUnreachable:
            return None


def start_request(box: Box, checks: dict[str, Any], *, start: bool = True) -> dict[str, Any]:
    root = str(Path(box.state_dir).parent)
    return {
        **checks,
        "config": json_format.MessageToDict(config_for(box)),
        "config_path": f"{root}/sidecar.json",
        "log_path": f"{root}/sidecar.log",
        "start": start,
        "deadline_s": START_DEADLINE_S,
    }


async def up(
    box: Box,
    conn: Connector,
    checks: dict[str, Any],
    *,
    credentials: str | None = None,
    reconfigure: bool = False,
) -> UpResult:
    """`checks`: what the box-side start checks first (the durable dir, whether it is this box's own
    default, the profile's checks and inode floor). `credentials`: the durable store's, written
    0600 where the config says before the sidecar starts (over the request's stdin: never argv).
    `reconfigure`: a running sidecar of this version is restarted too, to read a changed config
    (its jobs and queues go on: they outlive it)."""
    req = start_request(box, checks)
    if credentials is not None:
        req["durable_credentials"] = credentials
    answer = await launch(conn, "start", req)
    findings = list(answer.get("findings", []))
    if "running" in answer:
        running = await _hello(conn, timeout_s=5.0)
        if running is None:
            raise SidecarUnreachable(
                f"a sidecar (pid {answer['running']}) holds {box.state_dir} but does not answer; stop it, "
                "or wait for it to finish starting, and run `up` again"
            )
        if running.version == __version__ and not reconfigure:
            note = ""
            if list(running.watch_dirs) != list(box.watch) or running.durable_url != box.durable:
                note = (
                    "the running sidecar keeps its own watch dirs and durable URL; `down` it to change them"
                )
            return UpResult(hello=running, started=False, note=note, findings=findings)
        logger.info(
            "restarting the sidecar (version %s) with version %s and its config", running.version, __version__
        )
        async with SidecarClient(await conn.target()) as c:
            await c.shutdown()
        if not await wait_gone(box, conn, running.pid, deadline_s=STOP_DEADLINE_S):
            raise ControllerError(
                f"the running sidecar (version {running.version}, pid {running.pid}) did not stop after "
                "Shutdown; "
                f"see {Path(box.state_dir).parent}/sidecar.log on the box"
            )
        answer = await launch(conn, "start", req)
    try:
        return await _started(box, conn, answer, findings)
    except BaseException:
        # An `up` that fails (or is interrupted) leaves no sidecar of its own running: the box's
        # record, and what an earlier teardown recorded, still describe it.
        await launch(conn, "stop", {"state_dir": box.state_dir}, timeout_s=STOP_DEADLINE_S + 15)
        raise


async def _started(
    box: Box, conn: Connector, answer: dict[str, Any], findings: list[dict[str, str]]
) -> UpResult:
    if "started" not in answer:
        raise ControllerError(
            f"a sidecar started meanwhile by something else holds {box.state_dir}; run `up` again"
        )
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        hello = await _hello(conn, timeout_s=2.0)
        if hello is not None:
            if hello.version != __version__:
                raise VersionMismatch(f"the sidecar that answered runs {hello.version}, not {__version__}")
            return UpResult(hello=hello, started=True, findings=findings)
        await conn.reset()
        await asyncio.sleep(0.1)
    raise SidecarUnreachable(
        f"the sidecar (pid {answer['started']}) started but did not answer through the link within "
        f"{START_DEADLINE_S:.0f}s"
    )


async def wait_gone(
    box: Box, conn: Connector, pid: int, *, deadline_s: float, forget_credentials: bool = False
) -> bool:
    """Wait until the sidecar's socket no longer answers AND it is gone on the box (its state dir's
    lock free, its pid dead). Asked on the box: its pids are not this machine's. The box is asked
    only once the socket is silent, less often the longer it takes. `forget_credentials`: once it is
    gone, the durable store's credentials file is removed from the box (the teardown's last use)."""
    req: dict[str, Any] = {"state_dir": box.state_dir, "pid": pid}
    if forget_credentials and box.durable_credentials:
        req["forget"] = f"{box.state_dir}/{CREDENTIALS_NAME}"
    deadline = time.monotonic() + deadline_s
    pause = 0.05
    while time.monotonic() < deadline:
        if await _hello(conn, timeout_s=0.5) is None:
            answer = await launch(conn, "gone", req, timeout_s=30)
            if answer.get("gone"):
                return True
            pause = min(pause * 2, 0.5)
        await asyncio.sleep(pause)
    return False
