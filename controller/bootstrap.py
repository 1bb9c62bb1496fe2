"""Bootstrap: start the sidecar of a box, idempotently, and wait for its Hello.

The box-side half (`python -m sidecar.launch start`, run through the box's connector) creates the
watched and durable dirs, checks the durable dir, writes the config (0600) and starts the sidecar
detached in its own session (it must outlive this CLI and the SSH session that started it), unless
a sidecar already holds the box's state dir. A second `up` with the same version leaves a running
sidecar alone; a sidecar of another version is shut down and restarted; a dead one is restarted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
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
from controller.errors import (
    ControllerError,
    SidecarMismatch,
    SidecarUnreachable,
    UsageError,
    VersionMismatch,
)
from controller.identity import credentials_digest, new_nonce
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
    return short_socket(Path(f"/tmp/boxwarden-{os.getuid()}"), str(box_dir))


def short_socket(directory: Path, owner: str) -> Path:
    """A socket in `directory` for the box whose directory (on the box) is `owner`: named by a
    digest of that whole path, never a part of it: two boxes never share one, however alike their
    names begin."""
    return directory / f"{blake3.blake3(owner.encode()).hexdigest()[:32]}.sock"


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
    findings: list[dict[str, str]] = field(default_factory=list)  # the box-side checks' findings
    restarted_for: list[str] = field(default_factory=list)  # what a running sidecar was restarted to take


async def answering(conn: Connector, timeout_s: float = 5.0) -> pb.HelloResponse | None:
    """The Hello of whatever sidecar answers through `conn` (any version, any box); None if none."""
    try:
        target = await conn.target()
    except SidecarUnreachable:
        return None
    async with SidecarClient(target) as c:
        try:
            return await c.hello(timeout_s=timeout_s, check_version=False)
        except SidecarUnreachable:
            return None


def start_request(
    box: Box,
    checks: dict[str, Any],
    *,
    start: bool = True,
    nonce: str = "",
    known_runs: Sequence[str] = (),
    closed_runs: Sequence[str] = (),
) -> dict[str, Any]:
    """`known_runs`: runs of the box this controller knows (its record's), besides `box.run_id`;
    `closed_runs`: those it tore down. A dead sidecar's state dir of any other run, or of a closed
    run another controller opened again, is not taken over (sidecar.launch)."""
    root = str(Path(box.state_dir).parent)
    return {
        "known_runs": list(known_runs),
        "closed_runs": list(closed_runs),
        "instance_id": box.instance_id,
        # A root other than the box's own ~/.boxwarden is named on its disk, so that every box's
        # `siblings` finds it: a durable tier's, and this machine's state home (another
        # BOXWARDEN_HOME's boxes on one machine share its instance too).
        "register_root": box.state_on_durable or not box.host,
        **checks,
        "config": json_format.MessageToDict(config_for(box)),
        "config_path": f"{root}/sidecar.json",
        "log_path": f"{root}/sidecar.log",
        "start": start,
        "deadline_s": START_DEADLINE_S,
        "nonce": nonce,
    }


FIXED = ("box_name", "state_dir", "socket_path", "watch_dirs", "durable_url", "run_id", "workdir",
         "exclude_patterns", "keep", "push_rate_bytes_s")  # fmt: skip
"""What a running sidecar's claims are about, or its record says it keeps: never changed by a restart."""


def differences(
    want: pb.SidecarConfig, running: pb.HelloResponse, credentials: str | None
) -> tuple[list[str], list[str]]:
    """How the running sidecar's configuration differs from the one `up` asks for: (what no restart
    may change, what a restart takes). `credentials`: the text of new credentials, if given."""
    have = running.config
    fixed: list[str] = []
    restart: list[str] = []
    for f in pb.SidecarConfig.DESCRIPTOR.fields:
        a, b = getattr(have, f.name), getattr(want, f.name)
        if list(a) != list(b) if f.is_repeated else a != b:
            line = f"{f.name}: {_show(a)} running, {_show(b)} asked"
            (fixed if f.name in FIXED else restart).append(line)
    if credentials is not None and running.credentials_digest != credentials_digest(
        running.nonce, credentials.encode()
    ):
        restart.append("durable credentials: new ones given")
    return fixed, restart


def _show(v: object) -> str:
    if isinstance(v, str):
        return repr(v) if v else "none"
    if not isinstance(v, (int, float)):
        return "[" + ", ".join(map(repr, v)) + "]"  # type: ignore[call-overload]
    return str(v)


def _who(hello: pb.HelloResponse) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(hello.started_at_unix_ns / 1e9))
    return (
        f"pid {hello.pid}, box {hello.box_name!r}, run {hello.run_id!r}, durable {hello.durable_url}, "
        f"started {started}"
    )


def check_running(box: Box, running: pb.HelloResponse, *, ours: str | None) -> None:
    """A running sidecar `up` may keep or restart: the box's own (its name, state dir), started or
    adopted by this controller. `ours`: the nonce the box's live record holds ("" for a record of a
    version that kept none: any is taken), None when this controller has no live record of the box."""
    if running.box_name != box.name or running.state_dir != box.state_dir:
        raise SidecarMismatch(
            f"the sidecar that answers for {box.name} is another box's ({_who(running)}, state dir "
            f"{running.state_dir}); nothing was changed. Two boxes share one socket: `down` the other one"
        )
    if ours is None or (ours and running.nonce != ours):
        raise SidecarMismatch(
            f"a sidecar that this controller did not start runs {box.name} ({_who(running)}). If you meant "
            f"to take it over from here (another controller or a lost state started it), run `boxwarden up "
            f"{box.name} --adopt` with the same --profile/--host: its run, store and watched dirs are then "
            "taken from it. Otherwise `down` it from the controller that started it"
        )


async def up(
    box: Box,
    conn: Connector,
    checks: dict[str, Any],
    *,
    credentials: str | None = None,
    reconfigure: bool = False,
    ours: str | None = None,
    known_runs: Sequence[str] = (),
    closed_runs: Sequence[str] = (),
) -> UpResult:
    """`checks`: what the box-side start checks first (the durable dir, whether it is this box's own
    default, the profile's checks and inode floor). `credentials`: the durable store's, written
    0600 where the config says before the sidecar starts (over the request's stdin: never argv).
    `reconfigure`: a running sidecar of this version is restarted too, to read a changed config
    (its jobs and queues go on: they outlive it). `ours`: the nonce of the sidecar the box's record
    says this controller started; a running sidecar with another is refused (`up --adopt` takes it).

    A running sidecar is left alone only when it runs exactly what is asked; otherwise it is restarted
    (a new version, new credentials or health settings: its run and ledger stay) or, where its claims
    would change meaning, refused with every difference."""
    nonce = new_nonce()
    req = start_request(box, checks, nonce=nonce, known_runs=known_runs, closed_runs=closed_runs)
    if credentials is not None:
        req["durable_credentials"] = credentials
    answer = await launch(conn, "start", req)
    findings = list(answer.get("findings", []))
    restarted_for: list[str] = []
    running: pb.HelloResponse | None = None
    if "running" in answer:
        running = await answering(conn, timeout_s=5.0)
        if running is None:
            raise SidecarUnreachable(
                f"a sidecar (pid {answer['running']}) holds {box.state_dir} but does not answer; stop it, "
                "or wait for it to finish starting, and run `up` again"
            )
        check_running(box, running, ours=ours)
        fixed, restarted_for = differences(config_for(box), running, credentials)
        if fixed and running.version == __version__:
            raise UsageError(
                f"the running sidecar of {box.name} differs from what `up` asks for in what its claims are "
                f"about ({'; '.join(fixed)}); nothing was changed. Give `up` what it runs, or `down` "
                f"{box.name} first"
            )
        if running.version != __version__:  # what else differs is this version's config: all of it
            restarted_for = [f"version {running.version} running, {__version__} here"]
        elif reconfigure and not restarted_for:
            restarted_for = ["health settings"]
        if not restarted_for:
            return UpResult(hello=running, started=False, findings=findings)
        logger.info("restarting the sidecar for: %s", "; ".join(restarted_for))
        async with SidecarClient(await conn.target()) as c:
            await c.shutdown()
        if not await wait_gone(box, conn, running.pid, deadline_s=STOP_DEADLINE_S):
            raise ControllerError(
                f"the running sidecar (version {running.version}, pid {running.pid}) did not stop after "
                "Shutdown; "
                f"see {Path(box.state_dir).parent}/sidecar.log on the box"
            )
        try:
            answer = await launch(conn, "start", req)
        except ControllerError as e:
            raise _restart_failed(box, running, restarted_for, credentials, e) from e
    try:
        res = await _started(box, conn, answer, findings, nonce)
    except BaseException as e:
        # An `up` that fails (or is interrupted) leaves no sidecar of its own running: the box's
        # record, and what an earlier teardown recorded, still describe it. Nor the credentials it
        # wrote: a box that did not come up has no record whose `down` would take them away.
        stop: dict[str, Any] = {"state_dir": box.state_dir}
        if credentials is not None:
            stop["forget"] = f"{box.state_dir}/{CREDENTIALS_NAME}"
        await launch(conn, "stop", stop, timeout_s=STOP_DEADLINE_S + 15)
        if restarted_for and running is not None and isinstance(e, ControllerError):
            raise _restart_failed(box, running, restarted_for, credentials, e) from e
        raise
    return dataclasses.replace(res, restarted_for=restarted_for)


def _restart_failed(
    box: Box, old: pb.HelloResponse, why: Sequence[str], credentials: str | None, e: ControllerError
) -> ControllerError:
    """An ordered restart whose new start failed: the old sidecar is stopped, and the user is told."""
    keys = (  # (only new credentials are removed with a start that failed; the old file stays)
        " The new credentials left the box with it: give --durable-credentials again."
        if credentials is not None
        else ""
    )
    return ControllerError(
        f"the running sidecar of {box.name} (pid {old.pid}) was stopped to restart it ({'; '.join(why)}), "
        f"and the new one did not start: {e} Nothing watches the box now (its jobs go on): fix the cause "
        f"and run `boxwarden up {box.name}` again.{keys}"
    )


async def _started(
    box: Box, conn: Connector, answer: dict[str, Any], findings: list[dict[str, str]], nonce: str
) -> UpResult:
    """Wait for the sidecar this `up` started (its pid and nonce) to answer through the link."""
    if "started" not in answer:
        raise ControllerError(
            f"a sidecar started meanwhile by something else holds {box.state_dir}; run `up` again"
        )
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        hello = await answering(conn, timeout_s=2.0)
        if hello is not None:
            if hello.nonce != nonce or hello.pid != answer["started"]:
                raise SidecarMismatch(
                    f"the sidecar started for {box.name} (pid {answer['started']}) is not the one that "
                    f"answers through the link ({_who(hello)}); nothing was recorded"
                )
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
    box: Box,
    conn: Connector,
    pid: int,
    *,
    deadline_s: float,
    forget_credentials: bool = False,
    torn_down: bool = False,
) -> bool:
    """Wait until the sidecar's socket no longer answers AND it is gone on the box (its state dir's
    lock free, its pid dead). Asked on the box: its pids are not this machine's. The box is asked
    only once the socket is silent, less often the longer it takes. `forget_credentials`: once it is
    gone, the durable store's credentials file is removed from the box (the teardown's last use).
    `torn_down`: the box's run is marked over on the box (sidecar.launch TORN_DOWN): no controller
    adopts it again, no meter stop of its instance waits for it."""
    req: dict[str, Any] = {"state_dir": box.state_dir, "pid": pid}
    if forget_credentials and box.durable_credentials:
        req["forget"] = f"{box.state_dir}/{CREDENTIALS_NAME}"
    if torn_down:
        req["torn_down"] = box.run_id
    deadline = time.monotonic() + deadline_s
    pause = 0.05
    while time.monotonic() < deadline:
        if await answering(conn, timeout_s=0.5) is None:
            answer = await launch(conn, "gone", req, timeout_s=30)
            if answer.get("gone"):
                return True
            pause = min(pause * 2, 0.5)
        await asyncio.sleep(pause)
    return False
