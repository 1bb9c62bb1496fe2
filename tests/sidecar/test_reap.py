"""ReapProcess against a real sidecar, with recorded NVML readings naming real processes: a VRAM
zombie is ended on request (SIGTERM, or SIGKILL after the grace for one that ignores it) and
journaled; a job's process, a job's keeper, the sidecar and its ancestors, a pid no reading lists and
one that already exited are refused with nothing sent. In process: the confirming GPU reading is one
begun after the request (never one already in flight), and a hung GPU probe refuses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.errors import PreconditionError
from sidecar.gpu import GpuReading
from sidecar.health import HealthHub
from sidecar.jobs import JobSupervisor
from sidecar.ledger import Ledger
from sidecar.storage import open_store
from tests.conftest import pid_alive, wait_until
from tests.sidecar.daemon import Daemon, running

GIB = 1 << 30

# Ignores SIGTERM, then says so: the reap must fall back to SIGKILL.
STUBBORN = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
STUBBORN += "time.sleep(600)\n"


def record(path: Path, pids: list[int]) -> str:
    """A recording of one GPU on which each of `pids` holds 1 GiB; the gpu_probe setting for it."""
    gpu = {
        "index": 0,
        "uuid": "GPU-0",
        "name": "NVIDIA H200",
        "memory_used_bytes": len(pids) * GIB,
        "memory_total_bytes": 141 * GIB,
        "processes": [{"pid": pid, "used_memory_bytes": GIB} for pid in pids],
    }
    path.write_text(json.dumps([{"gpus": [gpu]}]))
    return f"replay:{path}"


@contextlib.contextmanager
def started(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A process of this test's, ended by its PID (and waited for) whatever happens."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()


def reap(d: Daemon, pid: int, grace_s: int = 5) -> pb.ReapProcessResponse:
    resp: pb.ReapProcessResponse = d.stub.ReapProcess(
        pb.ReapProcessRequest(pid=pid, grace_s=grace_s), timeout=60
    )
    return resp


def refused(d: Daemon, pid: int, grace_s: int = 5) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        reap(d, pid, grace_s)
    return e.value


def reaped_events(d: Daemon) -> list[pb.Event]:
    return [e for e in d.events() if e.kind == pb.PROCESS_REAPED]


def zombie(pid: int) -> bool:
    """`pid` exited and waits for its parent (this test) to collect it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_a_vram_zombie_is_ended_with_sigterm_and_journaled(tmp_path: Path) -> None:
    with started(["sleep", "600"]) as victim:
        probe = record(tmp_path / "nvml.json", [victim.pid])
        with running(tmp_path / "box", gpu_probe=probe) as d:
            wait_until(lambda: any(a.kind == pb.VRAM_ZOMBIE for a in _alerts(d)), what="VRAM_ZOMBIE")
            resp = reap(d, victim.pid)
            assert resp.gone, resp.detail
            assert f"pid {victim.pid} (sleep) held {GIB} bytes of GPU 0 (GPU-0)" in resp.detail
            assert "sent SIGTERM;" in resp.detail and "SIGKILL" not in resp.detail
            # Its parent (this test) has not collected it yet: a zombie, which holds no GPU memory.
            assert zombie(victim.pid) and "zombie" in resp.detail and "no GPU memory" in resp.detail
            assert victim.wait(timeout=30) == -signal.SIGTERM  # really ended, by SIGTERM
            assert not Path(f"/proc/{victim.pid}").exists()
            assert [e.detail for e in reaped_events(d)] == [resp.detail]
            # Gone now: a second request finds nothing to end and journals nothing.
            assert refused(d, victim.pid).code() == grpc.StatusCode.NOT_FOUND
            assert len(reaped_events(d)) == 1


def test_one_that_ignores_sigterm_is_sigkilled_after_the_grace(tmp_path: Path) -> None:
    with started([sys.executable, "-c", STUBBORN]) as victim:
        assert victim.stdout is not None and victim.stdout.readline() == "ready\n"
        probe = record(tmp_path / "nvml.json", [victim.pid])
        with running(tmp_path / "box", gpu_probe=probe) as d:
            resp = reap(d, victim.pid, grace_s=1)
            assert resp.gone, resp.detail
            assert "sent SIGTERM, then SIGKILL after 1 s;" in resp.detail
            assert victim.wait(timeout=30) == -signal.SIGKILL
            (event,) = reaped_events(d)
            assert "SIGKILL" in event.detail


def test_the_sidecar_its_ancestors_and_what_no_reading_lists_are_refused(tmp_path: Path) -> None:
    with started(["sleep", "600"]) as unlisted, started(["true"]) as exited:
        wait_until(lambda: zombie(exited.pid), what="the exited process to be a zombie")
        # This test's own process is the sidecar's parent: listed as a GPU holder, still refused.
        probe = record(tmp_path / "nvml.json", [os.getpid(), exited.pid])
        with running(tmp_path / "box", gpu_probe=probe) as d:
            assert d.proc is not None
            e = refused(d, unlisted.pid)
            assert e.code() == grpc.StatusCode.NOT_FOUND
            assert "holds no GPU memory in a GPU reading taken now" in str(e.details())
            e = refused(d, d.proc.pid)
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "the sidecar" in str(e.details())
            e = refused(d, os.getpid())
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "ancestors" in str(e.details())
            assert refused(d, 1).code() == grpc.StatusCode.FAILED_PRECONDITION
            e = refused(d, exited.pid)  # listed, but it exited: a zombie holds no GPU memory
            assert e.code() == grpc.StatusCode.NOT_FOUND and "already exited (a zombie" in str(e.details())
            e = refused(d, unlisted.pid, grace_s=4000)
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "grace" in str(e.details())
            assert pid_alive(unlisted.pid) and pid_alive(d.proc.pid)
            assert reaped_events(d) == []


def test_a_jobs_process_and_its_keeper_are_never_reaped(tmp_path: Path) -> None:
    recording = tmp_path / "nvml.json"
    with running(tmp_path / "box", gpu_probe=record(recording, [])) as d:
        job = d.stub.StartJob(pb.StartJobRequest(argv=["sleep", "600"]), timeout=30).job
        try:
            keeper = int(Path(f"/proc/{job.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            # The recording is read when the sidecar starts: name the job's leader and keeper in
            # it, and start the sidecar again (jobs outlive it; it adopts the job again).
            d.kill(signal.SIGTERM)
            record(recording, [job.pid, keeper])
            d.start()
            wait_until(
                lambda: any(j.id == job.id and j.state == pb.JOB_STATE_RUNNING for j in _jobs(d)),
                what="the job adopted again",
            )
            e = refused(d, job.pid)
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"job {job.id}" in str(e.details()) and "boxwarden stop" in str(e.details())
            e = refused(d, keeper)
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "keeper" in str(e.details())
            assert pid_alive(job.pid) and pid_alive(keeper)
            assert reaped_events(d) == []
        finally:
            d.stub.StopJob(pb.StopJobRequest(id=job.id, grace_s=1), timeout=30)


def _alerts(d: Daemon) -> list[pb.Alert]:
    snap = next(iter(d.stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=10)))
    return list(snap.alerts)


def _jobs(d: Daemon) -> list[pb.Job]:
    return list(d.stub.ListJobs(pb.ListJobsRequest(), timeout=30).jobs)


# ------------------------------------------------------------------ the confirming reading, in process


class GatedProbe:
    """A GPU probe whose calls are numbered (the reading's `source` says which); a call waits while
    `gate` is closed (at most 30 s)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.began = threading.Event()  # set when a call begins
        self.calls = 0

    def sample(self) -> GpuReading:
        self.calls += 1
        n = self.calls
        self.began.set()
        self.gate.wait(30)
        return GpuReading((), (), f"call{n}")

    def close(self) -> None:
        self.gate.set()


def with_hub(tmp_path: Path, probe: GatedProbe, body: Callable[[HealthHub], Awaitable[None]]) -> None:
    async def main() -> None:
        ledger = Ledger(tmp_path / "ledger.db")
        jobs = JobSupervisor(ledger, tmp_path / "logs", tmp_path, lambda *event: None)
        store = open_store((tmp_path / "durable").as_uri(), ("t1", "default"))
        hub = HealthHub(
            paths=[],
            store=store,
            ledger=ledger,
            jobs=jobs,
            notify=lambda: None,
            gpu=probe,
            probe_timeout_s=0.5,
        )
        try:
            await body(hub)
        finally:
            probe.gate.set()
            hub.close()
            await jobs.close()

    (tmp_path / "durable").mkdir()
    asyncio.run(main())


def test_a_gpu_reading_in_flight_before_the_request_is_never_the_confirming_one(tmp_path: Path) -> None:
    probe = GatedProbe()

    async def body(hub: HealthHub) -> None:
        probe.gate.clear()
        sampler = asyncio.ensure_future(hub.sample())  # its GPU reading begins, and waits
        assert await asyncio.to_thread(probe.began.wait, 30) and probe.calls == 1
        now = asyncio.ensure_future(hub.gpu_reading_now())
        await asyncio.sleep(0)  # it asks while the sampler's reading is in flight
        probe.gate.set()
        assert (await now).source == "call2"  # begun after the request, not the one in flight
        await sampler

    with_hub(tmp_path, probe, body)


def test_no_fresh_gpu_reading_refuses_within_the_probe_deadline(tmp_path: Path) -> None:
    probe = GatedProbe()

    async def body(hub: HealthHub) -> None:
        assert (await hub.gpu_reading_now()).source == "call2"
        probe.gate.clear()  # NVML hangs from now on
        with pytest.raises(PreconditionError, match="no fresh GPU reading"):
            await hub.gpu_reading_now()

    with_hub(tmp_path, probe, body)
