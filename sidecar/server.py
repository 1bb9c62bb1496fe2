"""SidecarService: the gRPC face of the daemon — and the ONE place domain errors become status codes.

Handlers are thin: they validate, call the domain object, and translate. Streams send the current
state first (replayed journal, latest health snapshot), then wait on a Bell for more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar import __version__
from sidecar.bell import Bell
from sidecar.config import Settings
from sidecar.errors import (
    ChangedError,
    ConfigError,
    NotFoundError,
    PreconditionError,
    SidecarError,
    StorageError,
    UnsafePathError,
)
from sidecar.health import HealthHub, job_to_pb
from sidecar.identity import FileIdentity
from sidecar.jobs import JobSupervisor
from sidecar.ledger import ClaimRow, EventRow, Ledger
from sidecar.manifest import manifest_digest
from sidecar.paths import ArtifactNamer
from sidecar.sealer import Sealer

logger = logging.getLogger(__name__)

CHUNK = 1 << 20
STATUS: list[tuple[type[SidecarError], grpc.StatusCode]] = [
    (UnsafePathError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ChangedError, grpc.StatusCode.ABORTED),
    (StorageError, grpc.StatusCode.UNAVAILABLE),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
]


async def abort(context: Ctx, err: SidecarError) -> NoReturn:
    code = next((c for t, c in STATUS if isinstance(err, t)), grpc.StatusCode.UNKNOWN)
    await context.abort(code, str(err))
    raise AssertionError("abort returns only by raising")  # pragma: no cover


def claim_to_pb(c: ClaimRow) -> pb.Claim:
    return pb.Claim(
        path=c.path,
        size=c.size,
        blake3=c.blake3,
        sealed_at_unix_ns=c.sealed_at_ns,
        seq=c.seq,
        durable=c.durable,
        durable_at_unix_ns=c.durable_at_ns,
        push_error=c.push_error,
    )


def event_to_pb(e: EventRow) -> pb.Event:
    return pb.Event(
        seq=e.seq,
        at_unix_ns=e.at_ns,
        kind=pb.EventKind.Value(e.kind),
        path=e.path,
        job_id=e.job_id,
        detail=e.detail,
        size=e.size,
        blake3=e.blake3,
    )


@dataclass
class Parts:
    settings: Settings
    ledger: Ledger
    namer: ArtifactNamer
    sealer: Sealer
    jobs: JobSupervisor
    health: HealthHub
    journal: Bell
    started_at_ns: int
    request_shutdown: Callable[[], None]


Ctx = grpc.aio.ServicerContext[Any, Any]


class SidecarService:
    def __init__(self, parts: Parts) -> None:
        self._p = parts

    async def Hello(self, request: pb.HelloRequest, context: Ctx) -> pb.HelloResponse:
        s = self._p.settings
        return pb.HelloResponse(
            version=__version__,
            box_name=s.box_name,
            hostname=socket.gethostname(),
            boot_id=_boot_id(),
            profile=s.profile,
            watch_dirs=[str(d) for d in s.watch_dirs],
            durable_url=s.durable_url,
            started_at_unix_ns=self._p.started_at_ns,
            pid=os.getpid(),
            run_id=s.run_id,
            workdir=str(s.job_cwd),
        )

    async def ListArtifacts(self, request: pb.ListArtifactsRequest, context: Ctx) -> pb.ListArtifactsResponse:
        seq = self._p.ledger.last_seq()
        claims = self._p.ledger.current_claims()
        unsealed = await self._p.sealer.unsealed()
        return pb.ListArtifactsResponse(
            claims=[claim_to_pb(c) for c in claims],
            manifest_digest=manifest_digest(claims),
            unsealed=unsealed,
            seq=seq,
        )

    async def ReadArtifact(
        self, request: pb.ReadArtifactRequest, context: Ctx
    ) -> AsyncIterator[pb.ReadArtifactChunk]:
        try:
            path = self._p.namer.to_abs(request.path)
            claim = self._p.ledger.current(request.path)
            if claim is None:
                raise NotFoundError(f"{request.path!r} is not a current claim")
            if request.blake3 and request.blake3 != claim.blake3:
                raise PreconditionError(
                    f"{request.path!r} changed: the current claim is {claim.blake3[:12]}…"
                )
            if not 0 <= request.offset <= claim.size:
                raise PreconditionError(f"offset {request.offset} is outside 0..{claim.size}")
            # O_NONBLOCK: a FIFO swapped in for the file must not wedge the event loop on open().
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            await abort(context, NotFoundError(f"{request.path!r} is no longer on the box"))
        except SidecarError as e:
            await abort(context, e)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or FileIdentity.of(st) != claim.identity:
                await abort(context, ChangedError(f"{request.path!r} changed on disk since it was claimed"))
            offset = request.offset
            loop = asyncio.get_running_loop()
            while offset < claim.size:
                data = await loop.run_in_executor(None, os.pread, fd, min(CHUNK, claim.size - offset), offset)
                if not data:
                    await abort(context, ChangedError(f"{request.path!r} shrank while being read"))
                yield pb.ReadArtifactChunk(data=data, offset=offset, size=claim.size)
                offset += len(data)
            if offset == 0:
                yield pb.ReadArtifactChunk(data=b"", offset=0, size=0)
        finally:
            os.close(fd)

    async def WatchEvents(self, request: pb.WatchEventsRequest, context: Ctx) -> AsyncIterator[pb.Event]:
        seq = request.after_seq
        while True:
            ticket = self._p.journal.ticket()
            rows = self._p.ledger.events_after(seq)
            for r in rows:
                yield event_to_pb(r)
                seq = r.seq
            if rows:
                continue
            if request.replay_only:
                return
            await ticket.wait()

    async def WatchHealth(
        self, request: pb.WatchHealthRequest, context: Ctx
    ) -> AsyncIterator[pb.HealthSnapshot]:
        hub = self._p.health
        while True:
            ticket = hub.bell.ticket()
            yield hub.latest
            if request.once:
                return
            await ticket.wait()

    async def StartJob(self, request: pb.StartJobRequest, context: Ctx) -> pb.StartJobResponse:
        try:
            job = await self._p.jobs.start(
                list(request.argv),
                cell=request.cell,
                cwd=Path(request.cwd) if request.cwd else None,
                env=dict(request.env),
            )
        except SidecarError as e:
            await abort(context, e)
        return pb.StartJobResponse(job=job_to_pb(job))

    async def StopJob(self, request: pb.StopJobRequest, context: Ctx) -> pb.StopJobResponse:
        try:
            job = await self._p.jobs.stop(request.id, grace_s=float(request.grace_s or 10))
        except SidecarError as e:
            await abort(context, e)
        return pb.StopJobResponse(job=job_to_pb(job))

    async def ListJobs(self, request: pb.ListJobsRequest, context: Ctx) -> pb.ListJobsResponse:
        return pb.ListJobsResponse(jobs=[job_to_pb(j) for j in self._p.jobs.jobs()])

    async def TailLog(self, request: pb.TailLogRequest, context: Ctx) -> AsyncIterator[pb.TailLogChunk]:
        jobs = self._p.jobs.jobs()
        try:
            job = self._p.jobs.get(request.job_id) if request.job_id else (jobs[0] if jobs else None)
            if job is None:
                raise NotFoundError("no job has been started on this box")
        except SidecarError as e:
            await abort(context, e)
        offset = request.offset
        with open(job.log_path, "rb") as f:
            while True:
                ticket = self._p.journal.ticket()
                f.seek(offset)
                data = f.read(CHUNK)
                if data:
                    yield pb.TailLogChunk(data=data, offset=offset)
                    offset += len(data)
                    continue
                current = self._p.jobs.get(job.id)
                if not request.follow or current.state != "running":
                    return
                # New output does not ring the journal; poll the file at a modest pace meanwhile.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ticket.wait(), timeout=0.5)

    async def ReleaseArtifacts(
        self, request: pb.ReleaseArtifactsRequest, context: Ctx
    ) -> pb.ReleaseArtifactsResponse:
        try:
            deleted, kept = await self._p.sealer.release(
                request.manifest_digest, jobs_running=bool(self._p.jobs.running())
            )
        except SidecarError as e:
            await abort(context, e)
        return pb.ReleaseArtifactsResponse(deleted=deleted, kept=kept)

    async def Shutdown(self, request: pb.ShutdownRequest, context: Ctx) -> pb.ShutdownResponse:
        self._p.request_shutdown()
        return pb.ShutdownResponse(pid=os.getpid())


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
