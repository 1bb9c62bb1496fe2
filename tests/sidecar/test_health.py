"""Health: probes off the event loop (a hung probe leaves every RPC answering), alerts once per
episode and cleared, against a real sidecar: a hung FUSE mount, a small tmpfs, real jobs and their
logs, and recorded NVML readings played back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar import alerts
from sidecar.alerts import ALERT_CLEARED, PULSE_HOLD_S, AlertBook, Held
from sidecar.probethread import ProbeThread
from sidecar.progress import Progress
from tests.conftest import fuse_mount, wait_until
from tests.sidecar.daemon import Daemon, running

# ------------------------------------------------------------------------------------ in process


def test_a_hung_probe_answers_by_its_deadline_with_its_last_reading_marked_stale() -> None:
    release = threading.Event()
    calls: list[int] = []

    def probe() -> int:
        calls.append(1)
        if len(calls) == 2:  # the second call hangs until released (at most 30 s)
            release.wait(30)
        return len(calls)

    async def scenario() -> None:
        p = ProbeThread("t", probe, timeout_s=0.2)
        first = await p.read()
        assert (first.value, first.stale, first.error) == (1, False, "")
        t0 = time.monotonic()
        late = await p.read()
        again = await p.read()  # the call under way is past its deadline: answered at once
        assert time.monotonic() - t0 < 2.0  # two reads, bounded by the one deadline
        assert late.value == again.value == 1 and late.stale and again.stale
        assert "no answer" in again.error and again.age_s >= late.age_s >= 0.2
        assert len(calls) == 2  # a hung probe is never asked twice at once
        release.set()
        await answered(p)
        fresh = await p.read()
        assert fresh.value == 2 and not fresh.stale  # the late answer, once it came
        # As old as its question, not taken "now": asked for before the late read waited out its
        # 0.2 s deadline. (Compared with late.age_s, which counts from the first call's question,
        # it failed under load by the few milliseconds between the two questions.)
        assert fresh.age_s >= 0.2
        p.close()

    asyncio.run(scenario())


async def answered(p: ProbeThread[int], timeout: float = 30.0) -> None:
    """Await the answer of the call under way (set on the loop by the probe's thread)."""
    deadline = time.monotonic() + timeout
    while p._pending is not None and not p._pending[0].done():
        assert time.monotonic() < deadline, "the probe never answered"
        await asyncio.sleep(0.01)


def test_read_fresh_never_takes_an_answer_to_a_call_asked_before_it() -> None:
    """Review of the /proc scan change: a scan that missed its deadline and answered later was
    handed to the next read as fresh (age 0), so the release's stray check judged a table read
    long before it was asked (a stray started since was never looked at)."""
    release = threading.Event()
    calls: list[int] = []

    def probe() -> int:
        calls.append(1)
        if len(calls) == 1:
            release.wait(30)  # the first call hangs until released
        return len(calls)

    async def scenario() -> None:
        p = ProbeThread("t", probe, timeout_s=0.2)
        assert (await p.read()).stale  # the first call is stuck
        release.set()
        await answered(p)  # its late answer waits to be taken
        got = await p.read_fresh()  # it was asked before: not taken, the probe is asked again
        assert (got.value, got.stale) == (2, False) and len(calls) == 2
        p.close()

    asyncio.run(scenario())


def test_a_waiter_never_drops_the_call_another_waiter_asked_since() -> None:
    """Review: every waiter that woke on a finished call cleared the call under way, even one
    another waiter had asked since; the next read then asked the probe a second time at once."""
    gates = [threading.Event(), threading.Event()]
    calls: list[int] = []

    def probe() -> int:
        calls.append(1)
        if len(calls) <= 2:
            gates[len(calls) - 1].wait(30)
        return len(calls)

    async def scenario() -> None:
        p = ProbeThread("t", probe, timeout_s=10)
        x = asyncio.ensure_future(p.read())  # asks call 1
        await asyncio.sleep(0)
        a = asyncio.ensure_future(p.read_fresh())  # joins call 1, then asks call 2
        b = asyncio.ensure_future(p.read())  # joins call 1; wakes after a asked call 2
        await asyncio.sleep(0)
        gates[0].set()
        assert (await x).value == 1 and (await b).value == 1
        c = asyncio.ensure_future(p.read())  # must join call 2, not ask a third
        await asyncio.sleep(0)
        gates[1].set()
        assert (await a).value == 2 and (await c).value == 2
        assert len(calls) == 2
        p.close()

    asyncio.run(scenario())


def test_a_failing_probe_keeps_the_last_good_reading_and_says_why() -> None:
    answers: list[int | OSError] = [7, OSError(5, "Input/output error")]

    def probe() -> int:
        a = answers.pop(0)
        if isinstance(a, OSError):
            raise a
        return a

    async def scenario() -> None:
        p = ProbeThread("t", probe, timeout_s=1)
        assert (await p.read()).value == 7
        bad = await p.read()
        assert bad.value == 7 and bad.stale and "Input/output error" in bad.error
        p.close()

    asyncio.run(scenario())


def test_alert_book_fires_once_per_episode_and_clears() -> None:
    events: list[tuple[str, str]] = []
    now = [0.0]
    book = AlertBook(lambda kind, path, job, detail: events.append((kind, detail)), clock=lambda: now[0])
    for _ in range(3):
        book.hold("DISK_LOW", {"/w": Held("low", path="/w")})
    assert events == [("DISK_LOW", "low")]
    assert [(a.kind, a.subject) for a in book.active()] == [("DISK_LOW", "/w")]
    book.hold("DISK_LOW", {})
    assert events[-1] == (ALERT_CLEARED, "DISK_LOW: /w (low)") and book.active() == []
    book.hold("DISK_LOW", {"/w": Held("low again", path="/w")})  # a new episode fires again
    assert events[-1] == ("DISK_LOW", "low again")
    # A burst of moments is one episode, held PULSE_HOLD_S after the last.
    book.pulse("GPU_XID", "gpu1", Held("Xid 79"))
    book.hold_pulses(["GPU_XID"])
    now[0] = PULSE_HOLD_S - 1
    book.pulse("GPU_XID", "gpu1", Held("Xid 79"))
    book.hold_pulses(["GPU_XID"])
    assert [e for e in events if e[0] == "GPU_XID"] == [("GPU_XID", "Xid 79")]
    now[0] = 2 * PULSE_HOLD_S
    book.hold_pulses(["GPU_XID"])
    assert events[-1] == (ALERT_CLEARED, "GPU_XID: gpu1 (Xid 79)")


def test_stall_and_nonfinite_rules() -> None:
    assert alerts.stalled({"j1": 5.0, "j2": 0.5}, 2.0).keys() == {"j1"}
    base = Progress(None, 0.5, None, None, 3, 1, "loss=nan", 0)
    assert alerts.nonfinite("j1", base, seen=0) is not None  # the count grew
    assert alerts.nonfinite("j1", base, seen=1) is None  # seen, and the latest loss is finite
    assert alerts.nonfinite("j1", Progress(None, float("inf"), None, None, 4, 1, "loss=inf", 0), seen=1)


# ------------------------------------------------------------------------------- a real sidecar


def kinds(d: Daemon, kind: str) -> list[pb.Event]:
    return [e for e in d.events() if pb.EventKind.Name(e.kind) == kind]


def cleared(d: Daemon, what: str) -> list[pb.Event]:
    return [e for e in kinds(d, "ALERT_CLEARED") if e.detail.startswith(what)]


def snapshot(d: Daemon) -> pb.HealthSnapshot:
    return next(iter(d.stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=5)))


def newer_snapshot(d: Daemon, after_ns: int) -> pb.HealthSnapshot:
    snap: pb.HealthSnapshot = wait_until(
        lambda: (s := snapshot(d)).at_unix_ns > after_ns and s, what="a newer snapshot"
    )
    return snap


def test_a_durable_mount_that_stops_answering_leaves_every_rpc_answering(tmp_path: Path) -> None:
    flag = tmp_path / "hang"
    env = {"CIFUSE_EXACT": "1", "CIFUSE_HANG_STATFS": str(flag)}
    with fuse_mount(tmp_path, env) as mnt, running(tmp_path / "box", durable_url=mnt.as_uri()) as d:
        first = newer_snapshot(d, 0)
        assert any(x.role == "durable" for x in first.disks)
        flag.touch()  # statfs on the durable mount hangs from now on
        try:
            stale = wait_until(
                lambda: next((p for p in snapshot(d).probes if p.name == "host" and p.stale), None),
                what="the host probe reported stale",
            )
            assert "no answer" in stale.error
            for _ in range(3):  # every RPC still answers within its deadline
                t0 = time.monotonic()
                d.stub.Hello(pb.HelloRequest(), timeout=2)
                d.stub.ListArtifacts(pb.ListArtifactsRequest(), timeout=2)
                d.stub.ListJobs(pb.ListJobsRequest(), timeout=5)
                snap = newer_snapshot(d, snapshot(d).at_unix_ns)
                assert time.monotonic() - t0 < 5
                host = next(p for p in snap.probes if p.name == "host")
                assert host.stale and host.age_s > 0
                assert any(x.role == "durable" for x in snap.disks)  # the last good reading
        finally:
            flag.unlink()
        wait_until(
            lambda: not next(p for p in snapshot(d).probes if p.name == "host").stale,
            what="the host probe fresh again",
        )


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    point = tmp_path / "small"
    point.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,nr_inodes=400", "tmpfs", str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)


def test_disk_and_inode_alerts_fire_once_per_episode_and_clear(tmp_path: Path, small_tmpfs: Path) -> None:
    state = small_tmpfs / "state"
    with running(tmp_path / "box", state_dir=str(state)) as d:
        where = str(state)
        assert not [e for e in kinds(d, "DISK_LOW") if e.path == where]  # 2 GiB free: fine
        filler = small_tmpfs / "filler"
        with open(filler, "wb") as f:  # leaves under 1 GiB free
            f.truncate(0)
            for _ in range(1100):
                f.write(b"\1" * (1 << 20))
        wait_until(lambda: [e for e in kinds(d, "DISK_LOW") if e.path == where], what="DISK_LOW")
        snap = newer_snapshot(d, newer_snapshot(d, 0).at_unix_ns)  # more samples, same episode
        assert [a.subject for a in snap.alerts if a.kind == pb.DISK_LOW] == [where]
        assert len([e for e in kinds(d, "DISK_LOW") if e.path == where]) == 1
        filler.unlink()
        wait_until(lambda: cleared(d, f"DISK_LOW: {where}"), what="DISK_LOW cleared")
        assert not [a for a in snapshot(d).alerts if a.kind == pb.DISK_LOW and a.subject == where]
        files = small_tmpfs / "files"
        files.mkdir()
        for i in range(390):  # fewer than 5 % of 400 inodes left
            (files / str(i)).touch()
        wait_until(lambda: [e for e in kinds(d, "INODES_LOW") if e.path == where], what="INODES_LOW")
        newer_snapshot(d, newer_snapshot(d, 0).at_unix_ns)
        assert len([e for e in kinds(d, "INODES_LOW") if e.path == where]) == 1
        for i in range(390):
            (files / str(i)).unlink()
        wait_until(lambda: cleared(d, f"INODES_LOW: {where}"), what="INODES_LOW cleared")


@contextlib.contextmanager
def started(d: Daemon, code: str) -> Iterator[pb.Job]:
    """A job running `code`, stopped at the end whatever happens (jobs outlive their sidecar)."""
    job = d.stub.StartJob(pb.StartJobRequest(argv=[sys.executable, "-c", code]), timeout=30).job
    try:
        yield job
    finally:
        d.stub.StopJob(pb.StopJobRequest(id=job.id, grace_s=1), timeout=30)


def test_a_nan_loss_raises_loss_nonfinite_within_two_seconds(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "print('step 1 loss=0.693', flush=True)\n"
        "while True:\n"
        "    time.sleep(0.2)\n"
        "    if __import__('os').path.exists(sys.argv[0] + '.go'): break\n"
        "print('step 2 loss=nan', flush=True)\n"
        "time.sleep(600)\n"
    ).replace("sys.argv[0]", repr(str(tmp_path / "job")))
    # The default interval.
    with running(tmp_path / "box", health_interval_ms=1000) as d, started(d, code) as job:
        wait_until(lambda: _progress(d, job.id).step == 1, what="step 1 in the health stream")
        assert _progress(d, job.id).loss == pytest.approx(0.693)
        (tmp_path / "job.go").touch()
        nan = wait_until(lambda: [e for e in kinds(d, "LOSS_NONFINITE") if e.job_id == job.id], timeout=10)
        printed_ns = os.stat(job.log_path).st_mtime_ns
        assert nan[0].at_unix_ns - printed_ns < 2e9, "LOSS_NONFINITE more than 2 s after the line"
        assert "loss=nan" in nan[0].detail
        assert _progress(d, job.id).nonfinite == 1


def _progress(d: Daemon, job_id: str) -> pb.JobProgress:
    """The job's progress in the latest snapshot (empty before the job is in one)."""
    return next((j.progress for j in snapshot(d).jobs if j.id == job_id), pb.JobProgress())


def test_a_job_that_goes_quiet_is_stalled_once_and_cleared_when_it_speaks(tmp_path: Path) -> None:
    go = tmp_path / "speak"
    code = (
        "import os, time\n"
        "print('step 1 loss 1.0', flush=True)\n"
        f"while not os.path.exists({str(go)!r}):\n"
        "    time.sleep(0.1)\n"
        "print('step 2 loss 0.9', flush=True)\n"
        "time.sleep(600)\n"
    )
    with running(tmp_path / "box", stall_s=2) as d, started(d, code) as job:
        stalled = wait_until(lambda: [e for e in kinds(d, "JOB_STALLED") if e.job_id == job.id], timeout=15)
        newer_snapshot(d, newer_snapshot(d, 0).at_unix_ns)
        assert len([e for e in kinds(d, "JOB_STALLED") if e.job_id == job.id]) == 1
        assert "no log line" in stalled[0].detail
        assert [a.subject for a in snapshot(d).alerts if a.kind == pb.JOB_STALLED] == [job.id]
        go.touch()
        wait_until(lambda: cleared(d, f"JOB_STALLED: {job.id}"), what="JOB_STALLED cleared")


def test_recorded_nvml_readings_raise_xid_throttle_and_zombie_alerts(tmp_path: Path) -> None:
    gpu = {
        "index": 0,
        "uuid": "GPU-0",
        "name": "NVIDIA H200",
        "utilization_percent": 99,
        "memory_used_bytes": 1 << 30,
        "memory_total_bytes": 141 << 30,
        "temperature_c": None,
        "power_w": 700.0,
        "power_limit_w": 700.0,
        "throttle_reasons": ["sw_power_cap"],
        "ecc_uncorrected": None,
        "processes": [{"pid": 1, "used_memory_bytes": 1 << 30}],  # not any job's: a zombie
    }
    recording = tmp_path / "nvml.json"
    readings = [
        {"gpus": [gpu]},
        {"gpus": [gpu], "xids": [{"gpu_index": 0, "uuid": "GPU-0", "xid": 79, "at_ns": 1}]},
        {"gpus": [{**gpu, "throttle_reasons": [], "processes": []}]},
    ]
    recording.write_text(json.dumps(readings))
    with running(tmp_path / "box", gpu_probe=f"replay:{recording}") as d:
        wait_until(lambda: cleared(d, "GPU_THROTTLE: gpu0"), what="the throttle to end")
        wait_until(lambda: cleared(d, "VRAM_ZOMBIE: 1"), what="the zombie to go")
        assert [e.detail for e in kinds(d, "GPU_XID")] == ["GPU 0 (GPU-0): Xid 79"]
        assert len(kinds(d, "GPU_THROTTLE")) == 1 and "power cap" in kinds(d, "GPU_THROTTLE")[0].detail
        assert len(kinds(d, "VRAM_ZOMBIE")) == 1 and "pid 1 " in kinds(d, "VRAM_ZOMBIE")[0].detail
        snap = snapshot(d)
        assert snap.gpu_source == "replay" and len(snap.gpus) == 1
        g = snap.gpus[0]
        assert g.utilization_percent == 99 and g.power_w == 700.0
        assert not g.HasField("temperature_c") and not g.HasField("ecc_uncorrected")  # absent, not 0


def test_a_job_killed_by_its_cgroup_memory_limit_raises_oom_kill(tmp_path: Path) -> None:
    """The sidecar (and so its jobs) in a child memory cgroup of this v1 machine with a limit; the
    job allocates past it and the kernel kills it."""
    base = Path("/sys/fs/cgroup/memory")
    if not (base / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller here")
    cg = base / f"bw-health-{os.getpid()}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(256 << 20))
        join = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"]
        hog = "b = []\nwhile True:\n    b.append(bytearray(8 << 20))\n"
        with running(tmp_path / "box", prefix=join) as d, started(d, hog) as job:
            oom = wait_until(lambda: kinds(d, "OOM_KILL"), timeout=60, what="OOM_KILL")
            assert job.id in oom[0].detail and "exit -9" in oom[0].detail
            ended = [e for e in kinds(d, "JOB_EXITED") if e.job_id == job.id]
            assert [e.detail for e in ended] == ["-9"]
            mem = snapshot(d).memory
            assert mem.cgroup_version == 1 and mem.limit_bytes == 256 << 20 and mem.oom_kills >= 1
            assert d.proc is not None and d.proc.poll() is None  # the sidecar itself lives on
    finally:
        wait_until(lambda: not (cg / "cgroup.procs").read_text().split(), what="the cgroup to empty")
        cg.rmdir()


def test_the_sidecar_serves_its_health_to_a_prometheus_scrape(tmp_path: Path) -> None:
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as s:  # a free loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with running(tmp_path / "box", metrics_port=port) as d:
        (d.watch / "a.bin").write_bytes(b"x" * 1000)
        d.wait_durable(1)

        def scrape() -> dict[str, list[tuple[dict[str, str], float]]]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            return {
                f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)
            }

        m = wait_until(
            lambda: (x := scrape()).get("boxwarden_claims_durable", [({}, 0)])[0][1] == 1 and x,
            what="a scrape that shows the durable claim",
        )
        assert m["boxwarden_claims_durable"][0] == ({"box": "t1", "run_id": "default"}, 1.0)
        roles = {labels["role"] for labels, _ in m["boxwarden_disk_free_bytes"]}
        assert roles == {"watch", "durable", "state", "root"}  # the workdir is the state dir here
        assert m["boxwarden_memory_host_total_bytes"][0][1] > 0
        assert {labels["probe"] for labels, _ in m["boxwarden_probe_stale"]} == {"host", "gpu", "progress"}
