"""A real sidecar process on a real Unix socket, for the sidecar's own tests (sync gRPC client)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from boxwarden_pb.v1 import sidecar_pb2 as pb
from boxwarden_pb.v1 import sidecar_pb2_grpc
from google.protobuf import json_format

from tests.conftest import REPO, pid_alive, wait_until


@dataclass
class Daemon:
    root: Path
    watch: Path
    durable: Path
    state: Path
    socket: Path
    config: Path
    proc: subprocess.Popen[bytes] | None = None
    channel: grpc.Channel | None = None
    extra: dict[str, object] = field(default_factory=dict)
    # Run the daemon under this command prefix (e.g. setpriv to drop CAP_DAC_OVERRIDE).
    prefix: list[str] = field(default_factory=list)

    @property
    def stub(self) -> sidecar_pb2_grpc.SidecarStub:
        assert self.channel is not None
        return sidecar_pb2_grpc.SidecarStub(self.channel)

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
        with open(self.root / "sidecar.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "sidecar", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.channel = grpc.insecure_channel(f"unix:{self.socket}")
        wait_until(self._answers, timeout=30, what="the sidecar's Hello")

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"sidecar exited {self.proc.returncode}: {(self.root / 'sidecar.log').read_text()}"
            )
        try:
            self.stub.Hello(pb.HelloRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return True

    def run_foreground(self) -> subprocess.CompletedProcess[str]:
        """Run the daemon with this config in the foreground, for configs it must refuse at start."""
        return subprocess.run(
            [sys.executable, "-m", "sidecar", "--config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._give_up(sig)
            self.proc = None

    def _give_up(self, sig: int) -> None:
        """The sidecar did not end: its threads' stacks into its log (SIGUSR1), then SIGKILL and a
        failure that shows them (and no live Popen left to warn in a later test)."""
        assert self.proc is not None
        log = self.root / "sidecar.log"
        size = log.stat().st_size
        os.kill(self.proc.pid, signal.SIGUSR1)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: log.stat().st_size > size, timeout=5, what="the stacks")
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None
        tail = log.read_text()[-12000:]
        raise AssertionError(f"the sidecar did not exit within 30 s of signal {sig}; its log (tail):\n{tail}")

    @property
    def store(self) -> Path:
        """Where this box's durable copies live: the durable URL's dir, the box name, the run id."""
        return self.durable / "t1" / "default"

    def claims(self) -> list[pb.Claim]:
        return list(self.listing().claims)

    def listing(self) -> pb.ListArtifactsResponse:
        """One whole listing (this test box is small: a single page)."""
        resp = self.stub.ListArtifacts(pb.ListArtifactsRequest(), timeout=10)
        assert not resp.next_page_token
        return resp

    def wait_durable(self, count: int, timeout: float = 60) -> list[pb.Claim]:
        def ok() -> list[pb.Claim] | None:
            cs = self.claims()
            return cs if len(cs) == count and all(c.durable for c in cs) else None

        try:
            return list(wait_until(ok, timeout=timeout, what=f"{count} durable claims"))
        except AssertionError as e:
            listing = self.listing()
            raise AssertionError(
                f"{e}\nclaims: {[(c.path, c.durable, c.push_error) for c in listing.claims]}\n"
                f"pending: {[(p.path, p.state, p.detail) for p in listing.pending]}\n"
                f"sidecar log (tail):\n{(self.root / 'sidecar.log').read_text()[-6000:]}"
            ) from None

    def events(self, after: int = 0) -> list[pb.Event]:
        return list(
            self.stub.WatchEvents(pb.WatchEventsRequest(after_seq=after, replay_only=True), timeout=10)
        )


def make_daemon(root: Path, sock_dir: Path, **cfg: object) -> Daemon:
    watch, durable, state = root / "watch", root / "durable", root / "state"
    watch.mkdir(parents=True, exist_ok=True)
    durable.mkdir(exist_ok=True)
    sock = sock_dir / "s.sock"
    msg = pb.SidecarConfig(
        box_name="t1",
        profile="local",
        state_dir=str(state),
        socket_path=str(sock),
        watch_dirs=[str(watch)],
        durable_url=durable.as_uri(),
        settle_ms=50,
        health_interval_ms=200,
        rescan_ms=1000,
        # A test sidecar stopped with claims not durable (a failing store) exits at once; tests
        # of the drain on SIGTERM give their own grace.
        drain_grace_s=1,
    )
    for k, v in cfg.items():
        setattr(msg, k, v)
    config = root / "sidecar.json"
    config.write_text(json_format.MessageToJson(msg))
    return Daemon(root=root, watch=watch, durable=durable, state=state, socket=sock, config=config)


@contextlib.contextmanager
def short_dir() -> Iterator[Path]:
    """A short, private directory for a socket (sun_path is ~107 bytes; tmp_path can be longer)."""
    d = Path(tempfile.mkdtemp(prefix="bwt-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def running(root: Path, *, prefix: list[str] | None = None, **cfg: object) -> Iterator[Daemon]:
    with short_dir() as sock_dir:
        d = make_daemon(root, sock_dir, **cfg)
        d.prefix = list(prefix or [])
        d.start()
        try:
            yield d
        finally:
            d.kill(signal.SIGTERM)


__all__ = ["Daemon", "make_daemon", "pid_alive", "running", "short_dir"]
