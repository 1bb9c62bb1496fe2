"""The daemon: builds every part on one asyncio loop, supervises the workers, shuts down in order.

Order on SIGTERM / SIGINT / the Shutdown RPC: stop the server (grace for in-flight calls) → cancel
the workers → stop and join the watcher off-loop → close the sealer and job waiters → close the
ledger → shut the executor down. Jobs are never killed by a sidecar shutdown: they outlive it.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import logging
import os
import signal
import stat
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import grpc
from boxwarden_pb.v1 import sidecar_pb2_grpc

from sidecar import __version__, children, mounts, resume, sockets, stamp
from sidecar.backlog import AT_RISK_SHOWN, Backlog
from sidecar.bell import Bell
from sidecar.cellqueue import QueueRunner
from sidecar.config import Settings
from sidecar.errors import ConfigError, PreconditionError
from sidecar.evidence import unsealed
from sidecar.gpu import GpuProbe, NullGpuProbe, ReplayGpuProbe, open_gpu_probe
from sidecar.health import HealthHub
from sidecar.jobrecord import JobRecord
from sidecar.jobs import JobSupervisor
from sidecar.ledger import Ledger
from sidecar.memprobe import MemoryProbe
from sidecar.metrics import MetricsServer
from sidecar.paths import ArtifactNamer
from sidecar.priority import lower_this_thread
from sidecar.probethread import ProbeThread
from sidecar.queuerecord import CellEvidence, evidence_of
from sidecar.release import Refusal, Releaser
from sidecar.retention import Retainer
from sidecar.rpcstamp import Stamp
from sidecar.sealer import Sealer
from sidecar.server import Parts, SidecarService, start_refusal
from sidecar.storage import open_store
from sidecar.storage.pace import Pace
from sidecar.strays import Caller, stray_line
from sidecar.watcher import Watcher

logger = logging.getLogger(__name__)

MAX_MESSAGE = 8 << 20
GPU_START_S = 15.0
RESCAN_SHARE = 0.003
"""The periodic rescan's most of one core (it waits this many times its own duration between two)."""
QUEUE_SETTLE_S = 10.0
"""How long after its job ended a finished cell with nothing claimed counts as NO_CHECKPOINT (plus
the settle time of a write): its last save may still be on its way to a claim."""
SHUTDOWN_MARGIN_S = 1.5
"""Of the grace between SIGTERM and SIGKILL, what the drain leaves for the orderly shutdown."""


def _mount_signatures(ledger: Ledger, s: Settings) -> dict[Path, str]:
    """Each watched dir's mount signature as this ledger first recorded it in this boot (a mount
    made while no sidecar ran is still a change); recorded now if there is none for this boot."""
    boot = mounts.boot_id()
    out = {}
    for root, now in mounts.signatures(s.watch_dirs, mounts.read()).items():
        key = f"watch-mounts:{root}"
        recorded_boot, _, recorded = (ledger.meta(key) or "").partition(" ")
        if not boot or recorded_boot != boot or not recorded:
            ledger.set_meta(key, f"{boot or '-'} {now}")
            recorded = now
        out[root] = recorded
    return out


async def _drain(backlog: Backlog, sealer: Sealer, ledger: Ledger, grace_s: float) -> None:
    """Before exiting: push what is not durable yet, within the grace the platform leaves between
    SIGTERM and SIGKILL (less a margin for the orderly shutdown), and journal what is still at risk.
    A checkpoint still being written counts (a trainer's own SIGTERM handler saving one last time):
    the drain waits for it to be closed, sealed and pushed."""
    budget = max(0.0, grace_s - SHUTDOWN_MARGIN_S)
    await sealer.stop_ahead()  # its pushes would take the workers from complete checkpoints
    logger.info("draining for up to %.1fs before exiting", budget)
    left = None
    async for risk in backlog.drain(budget, every_s=budget + 1, pending=functools.partial(unsealed, sealer)):
        left = risk  # the last word is what is still at risk
    if left is not None and (left.files or left.pending):
        paths = ", ".join([c.path for c in left.first] + left.pending[:AT_RISK_SHOWN])
        ledger.add_event(
            "DRAIN_UNFINISHED",
            detail=f"{left.files} claims ({left.bytes} bytes) not durable and {len(left.pending)} entries "
            f"not sealed at exit: {paths}",
        )
        logger.warning("exiting with %d claims (%d bytes) not durable, %d entries not sealed", left.files,
                       left.bytes, len(left.pending))  # fmt: skip


async def _gpu_probe(spec: str) -> GpuProbe:
    """The GPU probe the config names ("auto", "none", "replay:/path.json"). Starting NVML can
    hang on a sick driver: past GPU_START_S the sidecar goes on without GPU readings."""
    if spec.startswith("replay:"):
        try:
            return ReplayGpuProbe(spec[len("replay:") :])
        except (OSError, ValueError) as e:
            raise ConfigError(f"gpu_probe {spec!r}: {e}") from e
    prefer = "none" if spec == "none" else "auto"
    start = ProbeThread("gpu-start", lambda: open_gpu_probe(prefer=prefer), timeout_s=GPU_START_S)
    started = await start.read()  # on a daemon thread: a hung driver never holds up the exit
    start.close()
    if started.value is None:
        logger.warning("no GPU readings: NVML did not start (%s)", started.error)
        return NullGpuProbe(f"NVML did not start: {started.error}")
    return started.value


async def supervise(name: str, work: Callable[[], Awaitable[None]]) -> None:
    """Run a worker forever; an exception is logged with its traceback, then it restarts with backoff."""
    delay = 0.5
    while True:
        started = time.monotonic()
        try:
            await work()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("worker %s failed; restarting in %.1fs", name, delay)
        if time.monotonic() - started > 60:
            delay = 0.5
        await asyncio.sleep(delay)
        delay = min(delay * 2, 30.0)


def _private_dir(d: Path) -> None:
    """Create d 0700, or accept an existing d only if nobody else can enter it (never chmod a shared dir)."""
    if not d.exists():
        d.mkdir(parents=True, mode=0o700)
        d.chmod(0o700)
        return
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"{d} must be a directory of our own with mode 0700 (it is {stat.filemode(st.st_mode)}, "
            f"uid {st.st_uid}): the socket and ledger live there"
        )


def _prepare_dirs(s: Settings) -> None:
    for d in (s.state_dir, s.log_dir, s.socket_path.parent):
        _private_dir(d)


def _lock_state(s: Settings) -> IO[str]:
    """One sidecar per state dir: the ledger has exactly one writer."""
    f = open(s.state_dir / "sidecar.lock", "a+")  # noqa: SIM115 - held for the process lifetime
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        pid = s.pid_path.read_text().strip() if s.pid_path.exists() else "?"
        raise ConfigError(f"another sidecar already runs with state dir {s.state_dir} (pid {pid})") from None
    return f


def _bind_watch_dirs(ledger: Ledger, s: Settings) -> None:
    """Refuse to start with other watched dirs than the ones this ledger's current claims are about:
    the claims would all end as "deleted" while their files still sit, unwatched, on the box."""
    wanted = json.dumps([str(d) for d in s.watch_dirs])
    bound = ledger.meta("watch_dirs")
    if bound is not None and bound != wanted and ledger.counts.sealed:
        raise ConfigError(
            f"this box's ledger holds {ledger.counts.sealed} claims about the watched dirs "
            f"{', '.join(json.loads(bound))}; the config now names {', '.join(map(str, s.watch_dirs))}. "
            "Watch the same dirs (or tear the box down first, which releases those claims)"
        )
    if bound != wanted:
        ledger.set_meta("watch_dirs", wanted)


def _run_journal_start(ledger: Ledger, run_id: str) -> int:
    """The seq after which this run's journal starts. A ledger kept across runs (the box brought up
    again as a new run) holds the earlier runs' events: they are never replayed as this run's."""
    if ledger.meta("run_id") != run_id:
        ledger.set_meta("run_journal_from", str(ledger.last_seq()))
        ledger.set_meta("run_id", run_id)
    return int(ledger.meta("run_journal_from") or 0)


def _write_pid(path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, path)


async def jobs_in_the_way(
    jobs: JobSupervisor, waiting: Callable[[], list[str]], roots: list[str], caller: Caller | None
) -> list[Refusal]:
    """Why a release may not delete now: running, starting and restarting jobs and cells a queue
    will start (JOB_RUNNING), strays (STRAY_PROCESS). The scan (off the loop) comes first; every
    list is then read at one instant, so a job started while it ran is in one of them. A scan that
    does not answer is a JOB_RUNNING too: nothing then shows that no job runs."""
    try:
        found = await jobs.strays(roots, caller)  # scans /proc now: every job's membership too
    except PreconditionError as e:
        return [Refusal("JOB_RUNNING", detail=str(e))]
    lines = [f"job {j.id} (pids {' '.join(map(str, j.live_pids or [j.pid]))})" for j in jobs.running()]
    lines += [f"job {job_id} (starting)" for job_id in jobs.starting()]
    lines += [f"job {job_id} (failed; waiting to be started again)" for job_id in jobs.restart_pending()]
    lines += waiting()
    running = [Refusal("JOB_RUNNING", detail=line) for line in lines]
    return running + [Refusal("STRAY_PROCESS", detail=stray_line(x)) for x in found]


def _remove_own_pid(path: Path) -> None:
    """Remove the pid file if it still names this process: a sidecar still draining after its
    state dir was deleted and made again never takes away the pid file of the one started there
    since. (Its socket it cannot keep: gRPC unlinks the path as its listener closes; the state
    dir's lock keeps two sidecars off one state dir otherwise.)"""
    try:
        if path.read_text().strip() == str(os.getpid()):
            path.unlink()
    except (FileNotFoundError, UnicodeDecodeError):
        pass


async def run(s: Settings, environ: Mapping[str, str] | None = None) -> None:
    """Serve until SIGTERM, SIGINT or Shutdown. `environ`: what jobs inherit (default: ours)."""
    _prepare_dirs(s)
    lock = _lock_state(s)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The write-lease probe (openfiles.write_lease_blocked) can be broken by a writer's open();
    # the kernel then sends SIGIO, whose default action would end the daemon.
    signal.signal(signal.SIGIO, signal.SIG_IGN)

    ledger = Ledger(s.ledger_path)
    _bind_watch_dirs(ledger, s)
    journal_from = _run_journal_start(ledger, s.run_id)
    journal = Bell()
    ledger.add_event("SIDECAR_STARTED", detail=f"version {__version__} pid {os.getpid()}")
    # Each run of each box has its own corner of the durable store, owned by this ledger: boxes
    # sharing one URL, and runs reusing a box name, never overwrite each other's copies, and
    # clean_tmp only ever touches this run's temp files.
    pace = Pace(s.push_rate)
    nonce = s.nonce or stamp.new_nonce()
    credentials_digest = stamp.credentials_digest(
        nonce, s.durable_credentials.read_bytes() if s.durable_credentials is not None else None
    )
    store = open_store(s.durable_url, (s.box_name, s.run_id), credentials=s.durable_credentials, pace=pace)
    store.bind_owner(ledger.ledger_id)
    leftovers = store.clean_tmp()
    if leftovers:
        logger.info("removed %d leftover durable temp files from an earlier run", leftovers)
    reset = ledger.bind_store(f"{store.url}#{store.store_id()}")
    if reset:
        logger.warning("the durable store changed: %d claims will be pushed and proven again", reset)
    executor = ThreadPoolExecutor(
        max_workers=s.hash_workers, thread_name_prefix="hash", initializer=lower_this_thread
    )
    scan_executor = ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="scan", initializer=lower_this_thread
    )

    def emit(kind: str, job_id: str, detail: str) -> None:
        ledger.add_event(kind, job_id=job_id, detail=detail)
        journal.ring()

    # Orphans of our jobs reparent to us (a double-forked writer stays in view); we reap them.
    children.become_subreaper()
    children.install_reaper(loop)
    namer = ArtifactNamer(
        s.watch_dirs, s.temp_patterns, s.exclude_patterns, root_signatures=_mount_signatures(ledger, s)
    )

    sealer = Sealer(
        namer=namer,
        ledger=ledger,
        store=store,
        executor=executor,
        scan_executor=scan_executor,
        settle_s=s.settle_s,
        notify=journal.ring,
        ahead_min_bytes=s.ahead_min_bytes,
    )
    # A checkpoint's path components before its own: the cell (and the watched dir's name).
    skip = 2 if len(s.watch_dirs) > 1 else 1

    async def resume_for(job: JobRecord) -> str:
        """The checkpoint a restarted job resumes from: its cell's (<watch>/<cell>/) newest durable
        one, file or directory, that is still whole on the box; "" for none."""
        # A job without a cell: only what lies under its working directory, if that is watched
        # (never another job's checkpoints).
        dirs = [w / job.cell for w in s.watch_dirs] if job.cell else [Path(job.cwd)]
        prefixes = tuple(p for p in (namer.dir_prefix(d) for d in dirs) if p is not None)
        unsettled = sealer.dirty | sealer.busy_set()
        found = resume.candidates(
            ledger.current_claims(), prefixes, namer.to_abs, skip=skip, unsettled=unsettled
        )
        chosen = await asyncio.to_thread(resume.newest_loadable, found)
        return str(chosen.path) if chosen is not None else ""

    def resumed_from() -> list[str]:
        """What running jobs were told to resume from, as artifact paths: kept on the box."""
        named = (namer.to_artifact(Path(j.resume_from)) for j in jobs.running() if j.resume_from)
        return [a for a in named if a]

    jobs = JobSupervisor(
        ledger,
        s.log_dir,
        s.job_cwd,
        emit,
        reap=children.reap_orphans,
        environ=environ,
        resume_from=resume_for,
        aside=[s.boxes_root],
    )
    await jobs.recover()
    backlog = Backlog(
        ledger=ledger,
        push_pending=sealer.push_pending,
        busy=lambda: len(sealer.busy_set()),
        bandwidth=sealer.bandwidth,
        pace=pace,
    )
    retainer = Retainer(sealer, s.keep, protected=resumed_from)

    async def running_jobs(caller: Caller | None) -> list[Refusal]:
        return await jobs_in_the_way(jobs, queues.waiting, [str(d) for d in s.watch_dirs], caller)

    releaser = Releaser(sealer, running_jobs, pace)

    def cell_evidence(cells: Collection[str]) -> dict[str, CellEvidence]:
        owner = {}  # artifact path prefix of a cell's directory -> the cell
        for cell in cells:
            for w in s.watch_dirs:
                prefix = namer.dir_prefix(w / cell)
                if prefix:
                    owner[prefix] = cell
        return evidence_of(cells, owner, ledger.current_claims(), sealer.dirty | sealer.busy_set())

    queues = QueueRunner(
        ledger,
        jobs,
        lambda kind, detail: emit(kind, "", detail),
        cell_evidence,
        may_start=lambda: (start_refusal(releaser, s.box_name), releaser.released),
        settle_s=QUEUE_SETTLE_S + s.settle_s,
    )
    await queues.recover()
    restored = await releaser.restore_asides()
    if restored:
        logger.warning("put back %d files an interrupted release had renamed aside", restored)
    watcher = Watcher(s.watch_dirs, loop)
    sealer.on_root_replaced = watcher.rewatch
    watcher.start()  # before the first rescan, so nothing written in between is missed
    # Nothing reported what happened while no sidecar ran: a claim whose path no longer holds
    # exactly its file ends now, before any event is taken (its copy is kept, never superseded).
    ended = sealer.end_left(
        ("",), "changed or gone on the box while the sidecar was not running", same_inode_unsure=True
    )
    if ended:
        logger.warning(
            "%d claims changed or went while the sidecar was not running; their copies are kept", ended
        )
    # The container's own root too: RunPod's small overlay fills before /workspace does.
    disk_paths = [(d, "watch") for d in s.watch_dirs] + [(s.state_dir, "state")]
    for extra, role in ((s.job_cwd, "workdir"), (Path("/"), "root")):
        if all(extra != p for p, _ in disk_paths):
            disk_paths.append((extra, role))
    health = HealthHub(
        paths=disk_paths,
        store=store,
        ledger=ledger,
        jobs=jobs,
        notify=journal.ring,
        bandwidth=sealer.bandwidth,
        root_of=lambda art: namer.root_of(art)[0],
        on_space_freed=lambda: backlog.wake("the durable store has more room"),
        gpu=await _gpu_probe(s.gpu_probe),
        memory=MemoryProbe(),
        memory_high_percent=s.memory_high_percent,
        stall_s=s.stall_s,
        step_re=s.step_regex or None,
        loss_re=s.loss_regex or None,
    )

    metrics = None
    if s.metrics_port:
        metrics = MetricsServer(lambda: health.latest, box=s.box_name, run_id=s.run_id, port=s.metrics_port)
        metrics.start()
        logger.info("Prometheus metrics on http://127.0.0.1:%d/metrics", s.metrics_port)

    server = grpc.aio.server(
        interceptors=[Stamp(stamp.value(s.box_name, s.run_id, nonce))],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
        ],
    )
    parts = Parts(
        settings=s,
        ledger=ledger,
        namer=namer,
        sealer=sealer,
        releaser=releaser,
        jobs=jobs,
        health=health,
        journal=journal,
        started_at_ns=time.time_ns(),
        nonce=nonce,
        credentials_digest=credentials_digest,
        journal_from=journal_from,
        request_shutdown=stop.set,
        durable_root=store.url,
        backlog=backlog,
        store=store,
        queues=queues,
    )
    sidecar_pb2_grpc.add_SidecarServicer_to_server(SidecarService(parts), server)  # type: ignore[arg-type]
    socket_lock = sockets.claim(s.socket_path, s.state_dir)  # held for the process's life
    old_umask = os.umask(0o177)
    try:
        server.add_insecure_port(f"unix:{s.socket_path}")
        await server.start()
    finally:
        os.umask(old_umask)
    s.socket_path.chmod(0o600)
    _write_pid(s.pid_path)

    async def consume() -> None:
        while True:
            sealer.on_change(await watcher.queue.get())

    async def rescans() -> None:
        while True:
            await sealer.rescan()
            # The periodic rescan is a safety net (inotify's own overflow asks for one at once): it
            # may cost RESCAN_SHARE of a core at most. 10,000 files take ~0.2 s: one a minute.
            await asyncio.sleep(max(s.rescan_s, sealer.last_rescan_s / RESCAN_SHARE))

    workers = [
        loop.create_task(supervise(name, fn), name=name)
        for name, fn in (
            ("watcher", consume),
            ("rescan", rescans),
            ("push-retry", backlog.run),
            ("retention", retainer.run),
            ("health", lambda: health.run(s.health_interval_s)),
        )
    ]
    logger.info("sidecar %s serving on unix:%s (pid %d)", __version__, s.socket_path, os.getpid())
    try:
        await stop.wait()
        await queues.close()  # no cell starts while the box drains or shuts down
        for w in workers:
            if w.get_name() == "retention":
                w.cancel()  # no more re-reads for deletions while the grace runs out
        await _drain(backlog, sealer, ledger, s.drain_grace_s)
    finally:
        logger.info("shutting down")
        pace.end()  # a push still running finishes at full speed: the grace is running out
        await server.stop(grace=1.0)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        health.close()
        if metrics is not None:
            metrics.close()
        watcher.stop()
        await loop.run_in_executor(None, watcher.join)
        await queues.close()
        await sealer.close()
        await jobs.close()
        ledger.close()
        executor.shutdown(wait=True, cancel_futures=True)
        scan_executor.shutdown(wait=True, cancel_futures=True)
        store.close()
        _remove_own_pid(s.pid_path)
        sockets.release(s.socket_path, socket_lock)
        lock.close()
