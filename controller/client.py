"""SidecarClient: the controller's gRPC client — and the ONE place AioRpcError becomes a ControllerError.

Channels are created inside the running loop (grpc.aio requires it). Every unary call has a
deadline; streams have none (they end when the sidecar ends them or the caller stops reading).
A client made for a box (`expect`) takes an answer only from that box's sidecar: every answer names
who gives it (controller.identity), and is checked before it is used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from types import TracebackType
from typing import Any, Protocol, TypeVar

import grpc
from boxwarden_pb.v1 import sidecar_pb2 as pb
from boxwarden_pb.v1 import sidecar_pb2_grpc

from controller import __version__
from controller.errors import (
    ControllerError,
    SidecarMismatch,
    SidecarRefused,
    SidecarUnreachable,
    VersionMismatch,
)
from controller.identity import KEY, Expected, Stamp, check_stamp, hello_differences, refusal

logger = logging.getLogger(__name__)
T = TypeVar("T")

UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
MAX_MESSAGE = 8 << 20
STREAM_IDLE_S = 60.0
LIST_ATTEMPTS = 3
DRAIN_DEFAULT_S = 3600  # DrainRequest.timeout_s 0 means this
DRAIN_SLACK_S = 30.0


def translate(err: grpc.aio.AioRpcError, what: str) -> ControllerError:
    code = err.code()
    if code in UNREACHABLE:
        return SidecarUnreachable(f"{what}: the sidecar did not answer ({code.name}: {err.details()})")
    return SidecarRefused(f"{what}: {err.details()} ({code.name})", code.name)


class Link(Protocol):
    """What a client needs of a box's connector (controller.connector.Connector has it)."""

    async def target(self) -> str: ...
    def caller(self) -> pb.Caller | None: ...
    async def reset(self) -> None: ...


RECONNECT_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)


class SidecarClient:
    def __init__(
        self,
        target: str = "",
        *,
        timeout_s: float = 10.0,
        caller: pb.Caller | None = None,
        conn: Link | None = None,
        expect: Expected | None = None,
    ) -> None:
        """target: a gRPC target, e.g. "unix:/path/to/sidecar.sock"; or `conn`, the box's connector,
        which gives the target (and can build the link again: `reconnect`). caller: this process and
        its ancestors when the sidecar runs on this machine (see pb.Caller and `lineage`). expect:
        the box's sidecar as its record names it; an answer from any other raises SidecarMismatch
        (None: any sidecar's answer is taken, for `up`, which compares what it finds itself)."""
        self.target = target
        self.expect = expect
        self.timeout_s = timeout_s
        self.caller = caller
        self.conn = conn
        self.reconnects = 0
        self.generation = 0  # bumped each time `reconnect` opens a new channel
        self._reconnecting: asyncio.Lock | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: sidecar_pb2_grpc.SidecarAsyncStub | None = None

    async def __aenter__(self) -> SidecarClient:
        if self.conn is not None:
            self.caller = self.conn.caller()
            self.target = await self.conn.target()
        self._open()
        return self

    def _open(self) -> None:
        self._channel = grpc.aio.insecure_channel(
            self.target,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
            ],
        )
        self._stub = sidecar_pb2_grpc.SidecarStub(self._channel)

    async def reconnect(self, generation: int | None = None) -> None:
        """After a transport failure: wait a little (longer each time), build the link to the box
        again and open a new channel on it. Raises SidecarUnreachable if the link cannot be built.

        `generation`: the channel the caller saw fail (`self.generation` when its call began). Calls
        that share this client and saw the same channel fail rebuild it once: a later one finds the
        new channel and returns at once."""
        if self._reconnecting is None:
            self._reconnecting = asyncio.Lock()
        async with self._reconnecting:
            if generation is not None and generation != self.generation and self._channel is not None:
                return  # another call built the link again meanwhile
            wait = RECONNECT_BACKOFF_S[min(self.reconnects, len(RECONNECT_BACKOFF_S) - 1)]
            self.reconnects += 1
            if self._channel is not None:
                await self._channel.close()
                self._channel = None
            await asyncio.sleep(wait)
            try:
                if self.conn is not None:
                    await self.conn.reset()
                    self.target = await self.conn.target()
            finally:
                # Always a channel: on a link still down its calls fail as unreachable (and retry).
                self._open()
                self.generation += 1

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._channel is not None:
            await self._channel.close()

    @property
    def stub(self) -> sidecar_pb2_grpc.SidecarAsyncStub:
        assert self._stub is not None, "use `async with SidecarClient(...)`"
        return self._stub

    async def _answer(
        self, what: str, make: Callable[[], grpc.aio.UnaryUnaryCall[Any, T]]
    ) -> tuple[T, Stamp | None]:
        """The answer to one call, and who it says gave it."""
        try:
            call = make()
            resp = await call
            return resp, await _stamp_of(call, ended=True)
        except grpc.aio.AioRpcError as e:
            raise translate(e, what) from e

    async def _call(self, what: str, make: Callable[[], grpc.aio.UnaryUnaryCall[Any, T]]) -> T:
        resp, stamp = await self._answer(what, make)
        self._check(stamp, what)
        return resp

    def _check(self, stamp: Stamp | None, what: str) -> None:
        """Take the answer only from the expected sidecar; the first nonce seen is kept from then on."""
        if self.expect is None:
            return
        try:
            seen = check_stamp(self.expect, stamp, what)
        except SidecarMismatch:
            # `up` may have restarted (or adopted) the box's sidecar while this client followed it:
            # the record says so, and it is the record that names the one to take answers from.
            now = self.expect.reread()
            if now is None:
                raise
            self.expect = now
            seen = check_stamp(self.expect, stamp, what)
        if not self.expect.nonce:
            self.expect = dataclasses.replace(self.expect, nonce=seen.nonce)

    async def hello(self, *, timeout_s: float | None = None, check_version: bool = True) -> pb.HelloResponse:
        resp, stamp = await self._answer(
            "Hello", lambda: self.stub.Hello(pb.HelloRequest(), timeout=timeout_s or self.timeout_s)
        )
        if check_version and resp.version != __version__:
            raise VersionMismatch(
                f"the sidecar runs boxwarden {resp.version}, this controller is {__version__}; "
                "run `boxwarden up` again to restart it with this version"
            )
        self._check(stamp, "Hello")
        if self.expect is not None:
            diff = hello_differences(self.expect, resp)
            if diff:
                raise refusal(
                    self.expect, "Hello", Stamp(resp.box_name, resp.run_id, resp.nonce).show(), diff
                )
        return resp

    async def artifact_pages(self) -> AsyncIterator[pb.ListArtifactsResponse | None]:
        """The pages of one snapshot in order, each as it arrives, for a caller that works on a page
        while the sidecar is still walking the watched dirs for the last one.

        Each page is its own call with its own deadline, so a box with 100,000 claims never needs
        one long call. None means the snapshot expired between pages and the listing starts again
        from the start: drop every page received before it. The last page (no next_page_token)
        carries the final totals, and is yielded only once the counts of every page add up to them.
        """
        for attempt in range(LIST_ATTEMPTS):
            if attempt:
                yield None
            token, digest, n_claims, n_pending = "", None, 0, 0
            try:
                while True:
                    req = pb.ListArtifactsRequest(page_token=token)
                    page = await self._call(
                        "ListArtifacts",
                        lambda req=req: self.stub.ListArtifacts(req, timeout=self.timeout_s),  # type: ignore[misc]
                    )
                    if digest is None:
                        digest = page.manifest_digest
                    elif page.manifest_digest != digest:
                        raise SidecarRefused("ListArtifacts: a page of another snapshot arrived", "ABORTED")
                    n_claims += len(page.claims)
                    n_pending += len(page.pending)
                    token = page.next_page_token
                    if token:
                        yield page
                        continue
                    if n_claims != page.total_claims or n_pending != page.total_pending:
                        raise SidecarRefused(
                            f"ListArtifacts: got {n_claims} claims and {n_pending} pending entries, the "
                            f"sidecar announced {page.total_claims} and {page.total_pending}",
                            "DATA_LOSS",
                        )
                    yield page
                    return
            except SidecarRefused as e:
                if e.code == "ABORTED" and attempt + 1 < LIST_ATTEMPTS:
                    logger.info("listing restarted: %s", e)
                    continue
                raise

    async def list_artifacts(self) -> pb.ListArtifactsResponse:
        """Every page of one snapshot (see `artifact_pages`), merged into one response: claims and
        pending entries in order, the totals of the last page."""
        merged = pb.ListArtifactsResponse()
        async for page in self.artifact_pages():
            if page is None:
                merged = pb.ListArtifactsResponse()
                continue
            merged.claims.extend(page.claims)
            merged.pending.extend(page.pending)
            if not page.next_page_token:
                merged.manifest_digest = page.manifest_digest
                merged.seq = page.seq
                merged.total_claims = page.total_claims
                merged.total_pending = page.total_pending
                merged.excluded_files = page.excluded_files
                merged.excluded_sample.extend(page.excluded_sample)
        return merged

    async def list_jobs(self) -> pb.ListJobsResponse:
        return await self._call(
            "ListJobs",
            lambda: self.stub.ListJobs(pb.ListJobsRequest(caller=self.caller), timeout=self.timeout_s),
        )

    async def list_queues(self, name: str = "", *, brief: bool = False) -> list[pb.Queue]:
        """The box's queues (only `name`'s when given); `brief`: cells without their commands."""
        req = pb.ListJobsRequest(queues_only=True, queue=name, brief=brief)
        resp = await self._call("ListJobs", lambda: self.stub.ListJobs(req, timeout=self.timeout_s))
        return list(resp.queues)

    async def start_queue(self, req: pb.StartQueueRequest) -> pb.StartQueueResponse:
        return await self._call("StartQueue", lambda: self.stub.StartQueue(req, timeout=self.timeout_s))

    async def stop_queue(self, name: str, grace_s: int) -> pb.Queue:
        req = pb.StopQueueRequest(name=name, grace_s=grace_s)
        # As StopJob: the grace, then a few seconds for SIGKILL to land.
        resp = await self._call(
            "StopQueue", lambda: self.stub.StopQueue(req, timeout=grace_s + self.timeout_s)
        )
        return resp.queue

    async def start_job(self, req: pb.StartJobRequest) -> pb.Job:
        resp = await self._call("StartJob", lambda: self.stub.StartJob(req, timeout=self.timeout_s))
        return resp.job

    async def stop_job(self, job_id: str, grace_s: int) -> pb.Job:
        req = pb.StopJobRequest(id=job_id, grace_s=grace_s)
        # It waits out the grace, then up to a few seconds for SIGKILL to land.
        resp = await self._call("StopJob", lambda: self.stub.StopJob(req, timeout=grace_s + self.timeout_s))
        return resp.job

    async def reap_process(self, pid: int, grace_s: int) -> pb.ReapProcessResponse:
        req = pb.ReapProcessRequest(pid=pid, grace_s=grace_s)
        # It takes two GPU readings, waits out the grace, then up to a few seconds for SIGKILL.
        return await self._call(
            "ReapProcess", lambda: self.stub.ReapProcess(req, timeout=grace_s + 2 * self.timeout_s)
        )

    async def release(
        self, manifest_digest: str, *, accept_server_checksum: bool = False
    ) -> pb.ReleaseArtifactsResponse:
        req = pb.ReleaseArtifactsRequest(
            manifest_digest=manifest_digest, caller=self.caller, accept_server_checksum=accept_server_checksum
        )
        # It re-reads every durable copy before deleting anything: allow for a large tree.
        return await self._call("ReleaseArtifacts", lambda: self.stub.ReleaseArtifacts(req, timeout=3600))

    async def shutdown(self) -> pb.ShutdownResponse:
        return await self._call(
            "Shutdown", lambda: self.stub.Shutdown(pb.ShutdownRequest(), timeout=self.timeout_s)
        )

    async def health_once(self) -> pb.HealthSnapshot:
        async for snap in self._stream(
            "WatchHealth", lambda: self.stub.WatchHealth(pb.WatchHealthRequest(once=True))
        ):
            return snap
        raise SidecarUnreachable("WatchHealth: the sidecar sent no snapshot")

    def watch_health(self, *, idle_s: float = STREAM_IDLE_S) -> AsyncIterator[pb.HealthSnapshot]:
        """The latest health snapshot, then one per sampling interval, until cancelled; a sidecar
        that sends none for `idle_s` is unreachable."""
        return self._stream(
            "WatchHealth", lambda: self.stub.WatchHealth(pb.WatchHealthRequest()), idle_s=idle_s
        )

    def watch_events(self, after_seq: int, *, follow: bool) -> AsyncIterator[pb.Event]:
        """The box's journal after `after_seq`; with `follow`, then new events as they happen (a
        quiet box sends nothing for a long time: no idle limit then)."""
        req = pb.WatchEventsRequest(after_seq=after_seq, replay_only=not follow)
        idle = None if follow else STREAM_IDLE_S
        return self._stream("WatchEvents", lambda: self.stub.WatchEvents(req), idle_s=idle)

    def read_artifact(self, path: str, offset: int, blake3: str) -> AsyncIterator[pb.ReadArtifactChunk]:
        req = pb.ReadArtifactRequest(path=path, offset=offset, blake3=blake3)
        return self._stream(f"ReadArtifact {path}", lambda: self.stub.ReadArtifact(req))

    async def drain(self, *, wait: bool, timeout_s: int) -> AsyncGenerator[pb.DrainProgress, None]:
        """Ask the sidecar to push every claim not durable yet, newest first; yields what is still
        at risk: one message at once, then (with `wait`) one a second until the one with `done`.

        An older sidecar that does not know the call answers UNIMPLEMENTED: that is said plainly."""
        req = pb.DrainRequest(wait=wait, timeout_s=timeout_s)
        # The sidecar ends the stream itself at timeout_s: a deadline well after it ends one that
        # keeps talking past it (the idle limit ends one that stops talking).
        deadline = (timeout_s or DRAIN_DEFAULT_S) + DRAIN_SLACK_S if wait else self.timeout_s + DRAIN_SLACK_S
        try:
            async for progress in self._stream("Drain", lambda: self.stub.Drain(req, timeout=deadline)):
                yield progress
        except SidecarRefused as e:
            if e.code != grpc.StatusCode.UNIMPLEMENTED.name:
                raise
            raise SidecarRefused(
                "the box's sidecar is too old for drain (it does not know the Drain call); restart it "
                "with this controller's version (`boxwarden up` restarts a sidecar of another version)",
                e.code,
            ) from e

    def tail_log(
        self, job_id: str, offset: int = 0, *, follow: bool = False
    ) -> AsyncIterator[pb.TailLogChunk]:
        req = pb.TailLogRequest(job_id=job_id, offset=offset, follow=follow)
        # A quiet job sends nothing for a long time: no idle limit when following.
        idle = None if follow else STREAM_IDLE_S
        return self._stream("TailLog", lambda: self.stub.TailLog(req), idle_s=idle)

    async def _stream(
        self,
        what: str,
        make: Callable[[], grpc.aio.UnaryStreamCall[Any, T]],
        *,
        idle_s: float | None = STREAM_IDLE_S,
    ) -> AsyncIterator[T]:
        """Iterate a server stream; a sidecar that sends nothing for idle_s seconds is unreachable.
        Nothing of it is taken before it said who sends it (its initial metadata); a refusal is
        raised as such, as a unary call's is."""
        call = make()
        it = aiter(call)
        checked = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(anext(it), timeout=idle_s)
                except StopAsyncIteration:
                    if not checked:  # no message: the trailers may be all that came
                        self._check(await _stamp_of(call, ended=True), what)
                    return
                except TimeoutError as e:
                    raise SidecarUnreachable(f"{what}: the sidecar sent nothing for {idle_s:.0f}s") from e
                if not checked:  # nothing of it is taken before it said who sends it
                    self._check(await _stamp_of(call), what)
                    checked = True
                yield item
        except grpc.aio.AioRpcError as e:
            raise translate(e, what) from e
        finally:
            call.cancel()


async def _stamp_of(call: grpc.aio.Call, *, ended: bool = False) -> Stamp | None:
    """Who an answer says sent it: its initial metadata, or, for a call that `ended`, its trailers
    (the sidecar puts it in both: an answer with no message may come as trailers only)."""
    said = (await call.initial_metadata()).get(KEY)
    if said is None and ended:
        said = (await call.trailing_metadata()).get(KEY)
    return Stamp.parse(said)


def lineage(pid: int | None = None) -> pb.Caller:
    """This process (or `pid`) and its ancestors, from /proc, with what places their numbers (start
    times, PID namespace, boot): what a local box's sidecar is told so that the controller's own
    shell standing in the workdir is not taken for a job's stray."""
    out = pb.Caller()
    cur = os.getpid() if pid is None else pid
    while cur > 0 and cur not in out.pids:
        try:
            with open(f"/proc/{cur}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            break
        fields = stat[stat.rfind(b")") + 2 :].split()
        out.pids.append(cur)
        out.start_ticks.append(int(fields[19]))
        cur = int(fields[1])
    try:
        out.pid_ns = os.stat("/proc/self/ns/pid").st_ino
        with open("/proc/sys/kernel/random/boot_id") as f:
            out.boot_id = f.read().strip()
    except OSError:
        pass  # the sidecar then exempts nobody
    return out
