"""SshConnector: a box reached through the system's OpenSSH client.

Two modes, chosen per platform (`BOXWARDEN_SSH_MODE` overrides):
- `master` (POSIX): one ControlMaster per box, persisted across commands, with a forward of a local
  Unix socket (0700 dir under $BOXWARDEN_HOME) to the sidecar's socket on the box. Commands and
  copies are multiplexed over it.
- `tcp` (what Windows' OpenSSH can do): no master; a forward process of its own from a loopback
  TCP port, and a connection per command.

A transport failure (ssh exit 255) proves only that the transport failed: it is raised as
SidecarUnreachable, never read as a fact about the box. A host key that is unknown or changed, or
a login that would need a prompt, is a ControllerError that says what to run.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import signal
import socket
import tarfile
from collections.abc import Sequence
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.connector import Completed, run_process
from controller.errors import ControllerError, SidecarUnreachable
from controller.ssh import argv as sshargv
from controller.ssh import master
from controller.ssh.master import explain

logger = logging.getLogger(__name__)

SSH_FAILED = 255
MASTER_TRUST_S = 10.0
"""A master this connector saw live this recently is not asked again (`ssh -O check` is a process
of its own); a command that fails on the link makes it ask again."""


class SshConnector:
    def __init__(
        self,
        dest: sshargv.Destination,
        *,
        home: Path,
        tag: str,
        remote_socket: str = "",
        python: str = "",
        mode: str | None = None,
    ) -> None:
        """tag: the box's name: its controller-side sockets are named by it, `home` and `dest`."""
        self.dest = dest
        self.mode = mode or master.default_mode(os.environ)
        self.remote_socket = remote_socket
        self.python = python
        self._paths = master.LinkPaths.for_box(home, tag, dest)
        self._dir = self._paths.dir
        self.control_path = self._paths.control
        self.local_socket = self._paths.local_socket
        self._log = self._paths.log
        self._tunnel: asyncio.subprocess.Process | None = None
        self._port = 0
        self._forwarded = False
        self._master_seen = -MASTER_TRUST_S  # monotonic time this connector last saw its master live

    # -- the link ---------------------------------------------------------------------------

    async def _ssh(
        self,
        argv: list[str],
        *,
        stdin: bytes = b"",
        stdout: int | None = None,
        timeout_s: float | None = 60.0,
    ) -> Completed:
        logger.debug("ssh: %s", " ".join(argv))
        # start_new_session: a Ctrl-C of the CLI reaches ssh through us, not by itself. In "/", as
        # every ssh of ours: never in a local box's workdir (see master._start).
        return await run_process(
            argv,
            stdin=stdin,
            stdout=stdout,
            timeout_s=timeout_s,
            what=f"ssh to {self.dest.dest}",
            new_session=True,
            cwd="/",
        )

    async def master_pid(self) -> int | None:
        """The pid of this box's live ControlMaster, or None."""
        if self.mode != "master":
            return None
        return await asyncio.to_thread(master.master_pid, self.dest, self.control_path)

    async def _ensure_master(self, *, forward: bool = False) -> None:
        """A live master for this box (see master.ensure); started with the forward of the
        sidecar's socket when `forward`."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._master_seen < MASTER_TRUST_S:
            return
        if await asyncio.to_thread(
            master.ensure, self.dest, self._paths, self.remote_socket if forward else ""
        ):
            self._forwarded = True
        self._master_seen = loop.time()

    async def target(self) -> str:
        if not self.remote_socket:
            raise ControllerError("internal: the box's socket is not known yet")
        if self.mode == "tcp":
            return await self._tcp_target()
        await self._ensure_master(forward=True)
        if not self._forwarded:
            argv = sshargv.forward(self.dest, self.control_path, self.local_socket, self.remote_socket)
            done = await self._ssh(argv, timeout_s=30)
            if done.returncode != 0:
                raise explain(self.dest.dest, done.stderr.decode(errors="replace"))
            self._forwarded = True
        return f"unix:{self.local_socket}"

    async def _tcp_target(self) -> str:
        if self._tunnel is not None and self._tunnel.returncode is None:
            return f"ipv4:127.0.0.1:{self._port}"
        for _attempt in range(3):
            self._port = free_port()
            master.private_dir(self._dir)
            log = os.open(self._log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                self._tunnel = await asyncio.create_subprocess_exec(
                    *sshargv.tunnel(self.dest, self._port, self.remote_socket),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=log,
                    start_new_session=True,
                    cwd="/",
                )
            finally:
                os.close(log)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while loop.time() < deadline:
                if self._tunnel.returncode is not None:
                    break
                if _port_open(self._port):
                    return f"ipv4:127.0.0.1:{self._port}"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._tunnel.wait(), 0.05)
            else:
                await self._end_tunnel()
                raise SidecarUnreachable(f"the SSH forward to {self.dest.dest} did not open within 60s")
            text = self._log.read_text(errors="replace")
            if "Address already in use" not in text:  # lost the port race: another try
                raise explain(self.dest.dest, text)
        raise SidecarUnreachable(f"the SSH forward to {self.dest.dest} found no free local port")

    def caller(self) -> pb.Caller | None:
        return None  # the sidecar's box is not this machine: nothing here is exempt from its scans

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        stdout: int | None = None,
        timeout_s: float | None = 60.0,
    ) -> Completed:
        cp = None
        if self.mode == "master":
            await self._ensure_master()
            cp = self.control_path
        argv = sshargv.command(self.dest, argv, cp)
        done = await self._ssh(argv, stdin=stdin, stdout=stdout, timeout_s=timeout_s)
        if done.returncode == SSH_FAILED:
            self._master_seen = -MASTER_TRUST_S
            raise explain(self.dest.dest, done.stderr.decode(errors="replace"))
        return done

    async def put(self, files: Sequence[Path], remote_dir: str, *, timeout_s: float = 600.0) -> None:
        """A tar stream over the link into `remote_dir` (the box needs only `tar`)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for f in files:
                tar.add(f, arcname=f.name, recursive=False)
        script = 'mkdir -p -m 700 "$1" && exec tar -x -C "$1" -f -'
        done = await self.run(
            ["/bin/sh", "-c", script, "sh", remote_dir], stdin=buf.getvalue(), timeout_s=timeout_s
        )
        if done.returncode != 0:
            raise ControllerError(
                f"copying {len(files)} files to {self.dest.dest}:{remote_dir} failed: "
                f"{done.stderr.decode(errors='replace').strip()[-500:]}"
            )

    async def reset(self) -> None:
        self._forwarded = False
        self._master_seen = -MASTER_TRUST_S
        if self.mode == "tcp":
            await self._end_tunnel()
            return
        pid = await self.master_pid()
        if pid is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.control_path)

    async def _end_tunnel(self) -> None:
        if self._tunnel is not None and self._tunnel.returncode is None:
            _kill(self._tunnel, signal.SIGTERM)
            try:
                await asyncio.wait_for(self._tunnel.wait(), 5)
            except TimeoutError:
                _kill(self._tunnel)
                await self._tunnel.wait()
        self._tunnel = None

    async def close(self) -> None:
        """End what this connector started for one command; a master persists for the next."""
        await self._end_tunnel()

    async def exit_master(self) -> None:
        """Close the box's ControlMaster (at the end of `down`)."""
        await self._end_tunnel()
        if self.mode == "master" and os.path.exists(self.control_path):
            await self._ssh(sshargv.control(self.dest, self.control_path, "exit"), timeout_s=15)


def _kill(proc: asyncio.subprocess.Process, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
