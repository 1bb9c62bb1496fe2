"""The one seam between the controller and a box: how its sidecar is reached and how a command runs
on it. Every fact about a box (alive, gone, disks, tiers) is asked for through a Connector, never
read from a path or a process table of the controller's own machine.

`LocalConnector` is a box on this machine; `controller.ssh.connector.SshConnector` one reached
over OpenSSH. Both run the box-side half of `up` (`python -m sidecar.launch VERB`) the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.client import lineage
from controller.errors import ControllerError, SidecarMismatch, SidecarUnreachable, UsageError

BEGIN = "@@boxwarden-launch-begin@@"  # sidecar.launch's markers around its answer
END = "@@boxwarden-launch-end@@"


@dataclass(frozen=True)
class Completed:
    """A box-side command that ran to its end."""

    returncode: int
    stdout: bytes
    stderr: bytes


class Connector(Protocol):
    """How the controller reaches one box."""

    python: str
    """The box-side Python that runs the sidecar (an absolute path on the box)."""

    async def target(self) -> str:
        """The gRPC target of the box's sidecar, with the link to it up (built again if it dropped)."""
        ...

    def caller(self) -> pb.Caller | None:
        """What the sidecar may exempt from its stray scan: this process's lineage on a local box."""
        ...

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        stdout: int | None = None,
        timeout_s: float | None = 60.0,
    ) -> Completed:
        """Run `argv` on the box (never through a shell on this side) and wait for its end.
        `stdout`: an fd its output goes to (then `Completed.stdout` is empty); `timeout_s` None: no
        limit (the caller watches progress and cancels)."""
        ...

    async def put(self, files: Sequence[Path], remote_dir: str, *, timeout_s: float = 600.0) -> None:
        """Copy `files` into the box's directory `remote_dir` (created if missing)."""
        ...

    async def reset(self) -> None:
        """Drop the link after a transport failure, so the next `target` builds it again."""
        ...

    async def close(self) -> None:
        """End the link and whatever this connector started (a box-side sidecar keeps running)."""
        ...


async def launch(
    conn: Connector, verb: str, request: dict[str, Any], *, timeout_s: float = 120.0
) -> dict[str, Any]:
    """Run `sidecar.launch VERB` on the box and return its answer; a refusal raises (UsageError for
    what the user can fix, ControllerError for a box that cannot take the sidecar)."""
    done = await conn.run(
        [conn.python, "-m", "sidecar.launch", verb], stdin=json.dumps(request).encode(), timeout_s=timeout_s
    )
    out = done.stdout.decode(errors="replace")
    _, _, rest = out.partition(BEGIN)
    body, found, _ = rest.partition(END)
    if not found:
        err = done.stderr.decode(errors="replace").strip().splitlines()[-15:]
        raise ControllerError(
            f"the box-side `sidecar.launch {verb}` gave no answer (exit {done.returncode}):\n"
            + "\n".join(err)
        )
    answer: dict[str, Any] = json.loads(body)
    kind = answer.get("refused")
    if kind == "usage":
        raise UsageError(str(answer["message"]))
    if kind == "mismatch":
        raise SidecarMismatch(str(answer["message"]))
    if kind:
        raise ControllerError(str(answer["message"]))
    return answer


async def run_process(
    argv: Sequence[str],
    *,
    stdin: bytes,
    stdout: int | None,
    timeout_s: float | None,
    what: str,
    new_session: bool = False,
    cwd: str | None = None,
) -> Completed:
    """Run `argv` here to its end (killed if it outlives `timeout_s` or the caller is cancelled)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE if stdout is None else stdout,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=new_session,
        cwd=cwd,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
    except TimeoutError:
        _kill(proc)
        await proc.wait()
        raise SidecarUnreachable(f"{what} did not finish within {timeout_s:.0f}s") from None
    except BaseException:
        if proc.returncode is None:
            _kill(proc)
            await proc.wait()
        raise
    assert proc.returncode is not None
    return Completed(proc.returncode, out or b"", err)


def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


class LocalConnector:
    """A box on this machine: the sidecar's own socket, commands as this user's processes."""

    def __init__(self, socket: str, python: str = sys.executable) -> None:
        self.socket = socket
        self.python = python

    async def target(self) -> str:
        return f"unix:{self.socket}"

    def caller(self) -> pb.Caller | None:
        return lineage()

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        stdout: int | None = None,
        timeout_s: float | None = 60.0,
    ) -> Completed:
        # In "/", never in this shell's directory: that is where local boxes work, and the sidecar's
        # stray rule counts any process standing there (another box's teardown, run at once, took
        # this one's `sidecar.launch gone` for a stray and refused after it had deleted).
        return await run_process(argv, stdin=stdin, stdout=stdout, timeout_s=timeout_s, what=argv[0], cwd="/")

    async def put(self, files: Sequence[Path], remote_dir: str, *, timeout_s: float = 600.0) -> None:
        raise ControllerError("internal: a local box needs no files copied to it")

    async def reset(self) -> None:
        return None

    async def close(self) -> None:
        return None
