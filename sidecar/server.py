"""SidecarService: the gRPC face of the daemon. Handlers are thin: they validate, call the domain
object, and build the answer; every error leaves through `rpcerrors.translated`.

Streams send the current state first (replayed journal, latest health snapshot), then wait on a
Bell for more. ListArtifacts is paged over one snapshot, so 100,000 claims never need one long call;
the pages that hold only claims are answered while the walk of the watched dirs still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import secrets
import socket
import stat
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar import __version__, mounts, reap
from sidecar.backlog import AtRisk, Backlog
from sidecar.bell import Bell
from sidecar.cellqueue import QueueRunner
from sidecar.config import Settings
from sidecar.errors import ChangedError, NotFoundError, PreconditionError
from sidecar.evidence import CHANGED, TEMP, UNCLAIMABLE, WRITING, BoxEvidence, box_evidence, unsealed
from sidecar.hashing import new_hasher
from sidecar.health import HealthHub, job_to_pb
from sidecar.identity import FileIdentity
from sidecar.jobs import JobSupervisor
from sidecar.ledger import ClaimRow, EventRow, Ledger
from sidecar.manifest import manifest_digest
from sidecar.paths import ArtifactNamer, open_regular
from sidecar.queuerecord import Entry
from sidecar.release import Releaser
from sidecar.rpcerrors import translated
from sidecar.sealer import Sealer
from sidecar.storage import DurableStore
from sidecar.strays import Caller

logger = logging.getLogger(__name__)

CHUNK = 1 << 20
DRAIN_TIMEOUT_S = 3600
PAGE_SIZE = 20_000  # claims + pending entries per page: about 4 MiB, half the message limit
SNAPSHOT_TTL_S = 300.0
SNAPSHOTS_KEPT = 4
PENDING_STATES = {
    WRITING: pb.PENDING_WRITING,
    CHANGED: pb.PENDING_CHANGED,
    TEMP: pb.PENDING_TEMP,
    UNCLAIMABLE: pb.PENDING_UNCLAIMABLE,
}


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
        proven_at_unix_ns=c.proven_at_ns,
        proof=c.proof,
        durable_only=c.durable_only,
    )


def event_to_pb(e: EventRow) -> pb.Event:
    try:
        kind = pb.EventKind.Value(e.kind)
        detail = e.detail
    except ValueError:  # written by a newer version: pass it on rather than break the stream
        kind = pb.EVENT_KIND_UNSPECIFIED
        detail = f"{e.kind}: {e.detail}"
    return pb.Event(
        seq=e.seq,
        at_unix_ns=e.at_ns,
        kind=kind,
        path=e.path,
        job_id=e.job_id,
        detail=detail,
        size=e.size,
        blake3=e.blake3,
    )


@dataclass
class Parts:
    settings: Settings
    ledger: Ledger
    namer: ArtifactNamer
    sealer: Sealer
    releaser: Releaser
    jobs: JobSupervisor
    health: HealthHub
    journal: Bell
    started_at_ns: int
    nonce: str  # this start's token (sidecar.stamp)
    credentials_digest: str  # HelloResponse.credentials_digest
    journal_from: int  # the seq after which this run's journal starts (earlier runs' are not its)
    request_shutdown: Callable[[], None]
    durable_root: str
    backlog: Backlog
    store: DurableStore
    queues: QueueRunner


@dataclass
class _Snapshot:
    claims: list[pb.Claim]
    # The walk of the watched dirs, started with the snapshot: pages of claims alone are answered
    # while it runs; the page that holds the last claim waits for it.
    evidence: asyncio.Task[BoxEvidence]
    digest: str
    seq: int
    taken: float
    pending: list[pb.Pending] | None = None  # the walk's result as messages, once converted


Ctx = grpc.aio.ServicerContext[Any, Any]


def _retrieve(task: asyncio.Task[BoxEvidence]) -> None:
    """A walk nobody awaited (its listing was abandoned) must not log "exception never retrieved";
    the pages that do await it get its error."""
    if not task.cancelled():
        task.exception()


class _WireClaims:
    """The current claims as messages, and their digest, kept between listings: a row the ledger
    has not replaced (the same object) keeps its message, and an unchanged ledger (the same
    version) keeps the whole list and its digest. 100,000 claims convert in about a second
    otherwise. The version and the claims are read together, in one step on the loop thread: a
    list cached under a version it was not read at would be served, stale, until the next change."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[ClaimRow, pb.Claim]] = {}
        self._version = -1
        self._claims: list[ClaimRow] = []
        self._list: list[pb.Claim] = []
        self._digest = ""

    def of(self, ledger: Ledger) -> tuple[list[ClaimRow], list[pb.Claim], str]:
        if ledger.version != self._version:
            version, claims = ledger.version, ledger.current_claims()
            old, fresh = self._by_id, {}
            for c in claims:
                hit = old.get(c.id)
                fresh[c.id] = hit if hit is not None and hit[0] is c else (c, claim_to_pb(c))
            self._by_id = fresh
            self._claims = claims
            self._list = [fresh[c.id][1] for c in claims]
            self._digest = manifest_digest(claims)
            self._version = version
        return self._claims, self._list, self._digest


class SidecarService:
    def __init__(self, parts: Parts) -> None:
        self._p = parts
        self._snapshots: OrderedDict[str, _Snapshot] = OrderedDict()
        self._wire = _WireClaims()

    @translated
    async def Hello(self, request: pb.HelloRequest, context: Ctx) -> pb.HelloResponse:
        s = self._p.settings
        return pb.HelloResponse(
            version=__version__,
            box_name=s.box_name,
            hostname=socket.gethostname(),
            boot_id=mounts.boot_id(),
            profile=s.profile,
            watch_dirs=[str(d) for d in s.watch_dirs],
            durable_url=s.durable_url,
            started_at_unix_ns=self._p.started_at_ns,
            pid=os.getpid(),
            run_id=s.run_id,
            workdir=str(s.job_cwd),
            state_dir=str(s.state_dir),
            temp_patterns=list(s.temp_patterns),
            exclude_patterns=list(s.exclude_patterns),
            durable_root=self._p.durable_root,
            nonce=self._p.nonce,
            config=s.source,
            credentials_digest=self._p.credentials_digest,
        )

    def _snapshot(self) -> tuple[str, _Snapshot]:
        ledger = self._p.ledger
        seq = ledger.last_seq()
        claims, as_pb, digest = self._wire.of(ledger)
        # The claims, the sealer's dirty and busy sets and seq are read now, in one loop step.
        walk = box_evidence(self._p.sealer, claims)
        evidence = asyncio.get_running_loop().create_task(walk, name="listing-walk")
        evidence.add_done_callback(_retrieve)
        snap = _Snapshot(claims=as_pb, evidence=evidence, digest=digest, seq=seq, taken=time.monotonic())
        token = secrets.token_hex(8)
        self._snapshots[token] = snap
        while len(self._snapshots) > SNAPSHOTS_KEPT:
            self._snapshots.popitem(last=False)
        return token, snap

    @translated
    async def ListArtifacts(self, request: pb.ListArtifactsRequest, context: Ctx) -> pb.ListArtifactsResponse:
        size = min(request.page_size or PAGE_SIZE, PAGE_SIZE)
        if request.page_token:
            token, _, start_text = request.page_token.partition(":")
            snap = self._snapshots.get(token)
            if snap is None or time.monotonic() - snap.taken > SNAPSHOT_TTL_S or not start_text.isdigit():
                raise ChangedError(
                    "that listing expired (or the sidecar restarted): list again from the start"
                )
            start = int(start_text)
        else:
            token, snap = self._snapshot()
            start = 0
        n_claims = len(snap.claims)
        resp = pb.ListArtifactsResponse(manifest_digest=snap.digest, seq=snap.seq, total_claims=n_claims)
        if start + size < n_claims:
            # More claims follow this page: it need not wait for the walk (the controller works on
            # these claims meanwhile); the totals of pending entries come with the later pages.
            resp.claims.extend(snap.claims[start : start + size])
            resp.next_page_token = f"{token}:{start + size}"
            return resp
        # shield: a caller that gives up must not cancel the walk the other pages share.
        ev = await asyncio.shield(snap.evidence)
        if snap.pending is None:
            snap.pending = [
                pb.Pending(path=p.path, state=PENDING_STATES[p.state], detail=p.detail) for p in ev.pending
            ]
        pending = snap.pending
        end = min(start + size, n_claims + len(pending))
        resp.total_pending = len(pending)
        resp.excluded_files = ev.excluded_files
        resp.excluded_sample.extend(ev.excluded_sample)
        resp.claims.extend(snap.claims[start : min(end, n_claims)])
        resp.pending.extend(pending[max(start - n_claims, 0) : max(end - n_claims, 0)])
        if end < n_claims + len(pending):
            resp.next_page_token = f"{token}:{end}"
        else:
            self._snapshots.pop(token, None)
        return resp

    @translated
    async def ReadArtifact(
        self, request: pb.ReadArtifactRequest, context: Ctx
    ) -> AsyncIterator[pb.ReadArtifactChunk]:
        path = self._p.namer.to_abs(request.path)
        claim = self._p.ledger.current(request.path)
        if claim is None:
            raise NotFoundError(f"{request.path!r} is not a current claim")
        if request.blake3 and request.blake3 != claim.blake3:
            raise PreconditionError(f"{request.path!r} changed: the current claim is {claim.blake3[:12]}…")
        if not 0 <= request.offset <= claim.size:
            raise PreconditionError(f"offset {request.offset} is outside 0..{claim.size}")
        if claim.durable_only:
            # Retired: its bytes come from its durable copy (the box copy is gone).
            def rotten() -> str:
                # The only copy no longer holds the claimed bytes: say so everywhere, not only here.
                self._p.ledger.mark_not_durable(
                    claim.id, "MISMATCH: a read of the durable-only copy found other bytes"
                )
                self._p.journal.ring()
                return f"{claim.path!r}: its durable copy no longer holds the claimed bytes"

            from_store = functools.partial(self._p.store.read, claim.path)
            short = f"{claim.path!r}: its durable copy is shorter than the claim"
            async for chunk in _stream(claim, request.offset, from_store, short, rotten):
                yield chunk
            return
        try:
            # O_NONBLOCK: a FIFO swapped in for the file must not wedge the event loop on open().
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFoundError(f"{request.path!r} is no longer on the box") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or FileIdentity.of(st) != claim.identity:
                raise ChangedError(f"{request.path!r} changed on disk since it was claimed")

            def changed() -> str:
                # A mismatch is found here, on the box, and the file is sealed again instead of
                # the pull failing forever.
                self._p.sealer.force_reseal(request.path, "a read found other bytes than the claim's")
                return f"{request.path!r} changed on the box since its claim; it is being sealed again"

            def read(offset: int, n: int) -> bytes:
                return os.pread(fd, n, offset)

            short = f"{request.path!r} shrank while being read"
            async for chunk in _stream(claim, request.offset, read, short, changed):
                yield chunk
        finally:
            os.close(fd)

    @translated
    async def Drain(self, request: pb.DrainRequest, context: Ctx) -> AsyncIterator[pb.DrainProgress]:
        backlog = self._p.backlog
        sealer = self._p.sealer
        if not request.wait:
            backlog.wake("a drain was asked for")
            yield _progress(backlog.at_risk(), len((await box_evidence(sealer)).pending), done=True)
            return
        last: AtRisk | None = None
        timeout = float(request.timeout_s or DRAIN_TIMEOUT_S)
        async for risk in backlog.drain(timeout, pending=functools.partial(unsealed, sealer)):
            if last is not None:
                yield _progress(last, len(last.pending), done=False)
            last = risk
        assert last is not None
        # The last word counts every entry not sealed, unclaimable ones too: all are at risk.
        yield _progress(last, len((await box_evidence(sealer)).pending), done=True)

    @translated
    async def WatchEvents(self, request: pb.WatchEventsRequest, context: Ctx) -> AsyncIterator[pb.Event]:
        seq = max(request.after_seq, self._p.journal_from)  # this run's journal only
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

    @translated
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

    @translated
    async def StartJob(self, request: pb.StartJobRequest, context: Ctx) -> pb.StartJobResponse:
        why = start_refusal(self._p.releaser, self._p.settings.box_name)
        if not why and request.cell:
            why = self._p.queues.cell_busy(request.cell)
        if why:
            raise PreconditionError(why)
        job = await self._p.jobs.start(
            list(request.argv),
            cell=request.cell,
            cwd=Path(request.cwd) if request.cwd else None,
            env=dict(request.env),
            restart=request.restart,
            max_restarts=request.max_restarts,
            backoff_s=request.restart_backoff_s,
        )
        return pb.StartJobResponse(job=job_to_pb(job))

    @translated
    async def StartQueue(self, request: pb.StartQueueRequest, context: Ctx) -> pb.StartQueueResponse:
        why = start_refusal(self._p.releaser, self._p.settings.box_name)
        if why:
            raise PreconditionError(why)
        cells = [Entry(cell=c.cell, argv=list(c.argv), cwd=c.cwd, env=dict(c.env)) for c in request.cells]
        queue, started = await self._p.queues.start(
            request.name,
            cells,
            restart=request.restart,
            max_restarts=request.max_restarts,
            backoff_s=request.restart_backoff_s,
        )
        return pb.StartQueueResponse(queue=self._p.queues.to_pb(queue), started=started)

    @translated
    async def StopQueue(self, request: pb.StopQueueRequest, context: Ctx) -> pb.StopQueueResponse:
        queue = await self._p.queues.stop(request.name, grace_s=float(request.grace_s or 10))
        return pb.StopQueueResponse(queue=self._p.queues.to_pb(queue))

    @translated
    async def StopJob(self, request: pb.StopJobRequest, context: Ctx) -> pb.StopJobResponse:
        job = await self._p.jobs.stop(request.id, grace_s=float(request.grace_s or 10))
        return pb.StopJobResponse(job=job_to_pb(job))

    @translated
    async def ReapProcess(self, request: pb.ReapProcessRequest, context: Ctx) -> pb.ReapProcessResponse:
        p = self._p
        done = await reap.reap(
            request.pid,
            float(request.grace_s or reap.GRACE_S),
            health=p.health,
            jobs=p.jobs,
            ledger=p.ledger,
            notify=p.journal.ring,
        )
        return pb.ReapProcessResponse(gone=done.gone, detail=done.detail)

    @translated
    async def ListJobs(self, request: pb.ListJobsRequest, context: Ctx) -> pb.ListJobsResponse:
        if request.queues_only:
            wanted = [q for q in self._p.queues.queues() if not request.queue or q.name == request.queue]
            return pb.ListJobsResponse(queues=self._p.queues.listing(wanted, brief=request.brief))
        watched = [str(d) for d in self._p.settings.watch_dirs]
        found = await self._p.jobs.strays(  # scans /proc (off the loop) and every job's membership
            watched, _caller(request.caller) if request.HasField("caller") else None
        )
        jobs = self._p.jobs.jobs()
        return pb.ListJobsResponse(
            jobs=[job_to_pb(j) for j in jobs],
            strays=[
                pb.Stray(
                    pid=x.pid, command=x.command, cwd=x.cwd, started_at_unix_ns=x.started_at_ns, why=x.why
                )
                for x in found
            ],
        )

    @translated
    async def TailLog(self, request: pb.TailLogRequest, context: Ctx) -> AsyncIterator[pb.TailLogChunk]:
        jobs = self._p.jobs.jobs()
        job = self._p.jobs.get(request.job_id) if request.job_id else (jobs[0] if jobs else None)
        if job is None:
            raise NotFoundError("no job has been started on this box")
        offset = request.offset
        fd = _open_log(job.id, Path(job.log_path))
        try:
            while True:
                ticket = self._p.journal.ticket()
                data = await asyncio.to_thread(os.pread, fd, CHUNK, offset)  # the disk may be slow
                if data:
                    yield pb.TailLogChunk(data=data, offset=offset)
                    offset += len(data)
                    continue
                current = self._p.jobs.get(job.id)
                if not request.follow or current.state != "running":
                    return
                # New output does not ring the journal; poll the file at a modest pace meanwhile.
                with contextlib.suppress(asyncio.TimeoutError):  # not the builtin one before 3.11
                    await asyncio.wait_for(ticket.wait(), timeout=0.5)
        finally:
            os.close(fd)

    @translated
    async def ReleaseArtifacts(
        self, request: pb.ReleaseArtifactsRequest, context: Ctx
    ) -> pb.ReleaseArtifactsResponse:
        caller = _caller(request.caller) if request.HasField("caller") else None
        result = await self._p.releaser.release(
            request.manifest_digest, caller, accept_server_checksum=request.accept_server_checksum
        )
        return pb.ReleaseArtifactsResponse(
            deleted=result.deleted,
            kept=result.kept,
            refused=[pb.Refusal(code=r.code, path=r.path, detail=r.detail) for r in result.refused],
        )

    @translated
    async def Shutdown(self, request: pb.ShutdownRequest, context: Ctx) -> pb.ShutdownResponse:
        self._p.request_shutdown()
        return pb.ShutdownResponse(pid=os.getpid())


async def _stream(
    claim: ClaimRow,
    offset: int,
    read: Callable[[int, int], bytes],
    short: str,
    mismatch: Callable[[], str],
) -> AsyncIterator[pb.ReadArtifactChunk]:
    """A claim's bytes from `offset`, `read(offset, n)` at a time off the loop. From offset 0 the
    bytes sent are hashed too: when they are not the claim's, `mismatch()` acts on it and says why
    the read fails. `short`: why it fails when the bytes end before the claim's size."""
    loop = asyncio.get_running_loop()
    hasher = new_hasher() if offset == 0 else None
    while offset < claim.size:
        data = await loop.run_in_executor(None, read, offset, min(CHUNK, claim.size - offset))
        if not data:
            raise ChangedError(short)
        if hasher is not None:
            hasher.update(data)
        yield pb.ReadArtifactChunk(data=data, offset=offset, size=claim.size)
        offset += len(data)
    if hasher is not None and hasher.hexdigest() != claim.blake3:
        raise ChangedError(mismatch())
    if claim.size == 0:
        yield pb.ReadArtifactChunk(data=b"", offset=0, size=0)


def _progress(risk: AtRisk, pending: int, *, done: bool) -> pb.DrainProgress:
    return pb.DrainProgress(
        at_risk_files=risk.files,
        at_risk_bytes=risk.bytes,
        estimated_s=risk.estimated_s,
        push_bytes_per_s=risk.bytes_per_s,
        at_risk=[claim_to_pb(c) for c in risk.first],
        pending=pending,
        done=done,
    )


def _open_log(job_id: str, path: Path) -> int:
    """The job's log, opened read-only without ever blocking the loop: the job (or anyone who can
    write the log dir) may replace the file, and a plain open() of a FIFO waits for a writer
    forever, freezing every call. Only a regular file is read; a symlink is not followed."""
    try:
        return open_regular(path, follow=False)
    except OSError as e:  # ENOENT and the like leave as themselves (rpcerrors maps them by errno)
        if e.errno == errno.ELOOP:
            raise PreconditionError(
                f"the log of job {job_id} ({path}) was replaced by a symlink, which is never followed"
            ) from None
        if e.errno == errno.EINVAL:  # something else than a regular file: strerror says what
            raise PreconditionError(
                f"the log of job {job_id} ({path}) is {e.strerror}: it was replaced after the job "
                "started, so there is no log to show"
            ) from None
        raise


def start_refusal(releaser: Releaser, box: str) -> str:
    """Why no job may start on this box now ("" when one may)."""
    if releaser.active:
        return "a release is deleting this box's artifacts; no job may start now"
    if releaser.released:
        return _released_message(box)
    return ""


def _released_message(box: str) -> str:
    """Why no job may start once a release succeeded: the teardown's Shutdown comes next (or was
    interrupted), and a job started now would run on after `down` reported the box gone."""
    return (
        f"the artifacts of box {box} were released for its teardown, so no job may start on this "
        "sidecar: it would run on after `down` reports the box gone. If that `down` was interrupted, "
        f"finish it: `boxwarden down {box} --confirm {box}`. To keep working on the box instead, stop "
        f"this sidecar (`kill {os.getpid()}`) and run `boxwarden up {box}` again with the same arguments"
    )


def _caller(c: pb.Caller) -> Caller:
    return Caller(pids=tuple(c.pids), start_ticks=tuple(c.start_ticks), pid_ns=c.pid_ns, boot_id=c.boot_id)
