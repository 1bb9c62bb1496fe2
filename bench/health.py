"""Figure: what watching the box costs — a real sidecar sampling health at 1 Hz (the default).

- idle: 10,000 sealed, durable claims in its watched dir and nothing happening; the sidecar's CPU
  over the window against 1 % of one core, and its RSS at the end against 80 MiB;
- follow: the same sidecar while a job it supervises logs 1,000 lines/s (a step and a loss on
  each: every line is parsed), against 5 % of one core.

The sidecar is started directly (`python -m sidecar --config`), its jobs through StartJob; each
figure's "baseline" is its budget, so the ratio is the share of it used (≤ 1 passes).
Window: $BOXWARDEN_BENCH_HEALTH_S seconds (default 60); claims: $BOXWARDEN_BENCH_HEALTH_N.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from boxwarden_pb.v1 import sidecar_pb2 as pb
from boxwarden_pb.v1 import sidecar_pb2_grpc
from google.protobuf import json_format

from bench.common import (
    Context,
    FigureResult,
    Side,
    Timing,
    budget,
    clock,
    proc_cpu_s,
    proc_rss_bytes,
    start_sidecar,
)

logger = logging.getLogger(__name__)

KEY = "health"
IDLE_BUDGET = 0.01  # of one core
RSS_BUDGET_MIB = 80.0
FOLLOW_BUDGET = 0.05
LINES_PER_S = 1000
PER_DIR = 1000
READY_S = 600.0

# The job: LINES_PER_S lines a second, each with a step and a loss, kept to the clock.
JOB = """
import sys, time
rate, until = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
step, t0 = 0, time.monotonic()
while time.monotonic() < until:
    step += 1
    print(f"step {step} | loss={1.0 / step:.6f} | lr=0.0003 | 12.5 samples/s", flush=(step % 50 == 0))
    lag = t0 + step / rate - time.monotonic()
    if lag > 0:
        time.sleep(lag)
"""


def _health(stub: sidecar_pb2_grpc.SidecarStub) -> pb.HealthSnapshot:
    snap: pb.HealthSnapshot = next(iter(stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=10)))
    return snap


def _wait(what: str, until: float, check: Callable[[], bool]) -> None:
    while not check():
        if clock() > until:
            raise RuntimeError(f"{KEY}: timed out waiting for {what}")
        time.sleep(0.2)


def run(ctx: Context) -> list[FigureResult]:
    window = float(os.environ.get("BOXWARDEN_BENCH_HEALTH_S", "60"))
    n = int(os.environ.get("BOXWARDEN_BENCH_HEALTH_N", "10000"))
    base = ctx.work_dir / "health"
    watch, durable, state = base / "watch", base / "durable", base / "state"
    for d in (watch, durable):
        d.mkdir(parents=True)
    sock_dir = Path(tempfile.mkdtemp(prefix="bwh-", dir="/tmp"))
    config = base / "sidecar.json"
    msg = pb.SidecarConfig(
        box_name="health",
        state_dir=str(state),
        socket_path=str(sock_dir / "s.sock"),
        watch_dirs=[str(watch)],
        durable_url=durable.as_uri(),
        gpu_probe="none",
        rescan_ms=int(os.environ.get("BOXWARDEN_BENCH_HEALTH_RESCAN_MS", "0")),  # 0: the default
    )
    config.write_text(json_format.MessageToJson(msg))
    proc = start_sidecar(config, base / "sidecar.log")
    channel = grpc.insecure_channel(f"unix:{msg.socket_path}")
    stub = sidecar_pb2_grpc.SidecarStub(channel)
    try:
        deadline = clock() + READY_S

        def answers() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"{KEY}: the sidecar exited {proc.returncode}: see {base / 'sidecar.log'}")
            try:
                stub.Hello(pb.HelloRequest(), timeout=1)
            except grpc.RpcError:
                return False
            return True

        _wait("the sidecar's Hello", deadline, answers)
        for i in range(n):
            d = watch / f"d{i // PER_DIR:03d}"
            d.mkdir(exist_ok=True)
            (d / f"ckpt-{i:06d}.bin").write_bytes(os.urandom(256))
        t0 = clock()
        _wait(f"{n} durable claims", deadline, lambda: _health(stub).artifacts.durable >= n)
        print(f"  {n:,} claims durable {clock() - t0:.1f} s after the last write", file=sys.stderr)
        time.sleep(3.0)  # let the last notifications and pushes settle
        if os.environ.get("BOXWARDEN_BENCH_HEALTH_PROFILE"):  # where the idle time goes (py-spy)
            subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-p",
                    str(proc.pid),
                    "-d",
                    str(int(window)),
                    "-o",
                    os.environ["BOXWARDEN_BENCH_HEALTH_PROFILE"],
                    "-f",
                    "raw",
                    "--threads",
                    "--idle",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )

        cpu0, w0 = proc_cpu_s(proc.pid), clock()
        rss_max = 0
        while clock() - w0 < window:
            time.sleep(1.0)
            rss_max = max(rss_max, proc_rss_bytes(proc.pid))
        idle_cpu, idle_wall = proc_cpu_s(proc.pid) - cpu0, clock() - w0
        print(
            f"  idle: {100 * idle_cpu / idle_wall:.2f} % of a core over {idle_wall:.1f} s, "
            f"RSS up to {rss_max / (1 << 20):.1f} MiB",
            file=sys.stderr,
        )

        job = stub.StartJob(
            pb.StartJobRequest(argv=[sys.executable, "-c", JOB, str(LINES_PER_S), str(window + 10)]),
            timeout=60,
        ).job
        time.sleep(3.0)  # the job is up and logging
        cpu0, w0, step0 = proc_cpu_s(proc.pid), clock(), _step(stub, job.id)
        time.sleep(window)
        follow_cpu, follow_wall = proc_cpu_s(proc.pid) - cpu0, clock() - w0
        steps = _step(stub, job.id) - step0
        print(
            f"  following {steps / follow_wall:.0f} lines/s: "
            f"{100 * follow_cpu / follow_wall:.2f} % of a core over {follow_wall:.1f} s",
            file=sys.stderr,
        )
        if steps < 0.8 * LINES_PER_S * follow_wall:
            raise RuntimeError(
                f"{KEY}: the sidecar read {steps} steps in {follow_wall:.0f} s of a job logging more"
            )
        stub.StopJob(pb.StopJobRequest(id=job.id, grace_s=2), timeout=60)
    finally:
        channel.close()
        proc.terminate()  # our child: SIGTERM, and its drain (seconds) before it exits
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            logger.warning("the sidecar (pid %d) ignored SIGTERM for 60 s; killing it", proc.pid)
            proc.kill()
            proc.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)

    notes = [
        f"idle: {100 * idle_cpu / idle_wall:.2f} % of a core over {idle_wall:.1f} s with {n:,} claims; "
        f"RSS up to {rss_max / (1 << 20):.1f} MiB",
        f"following a job's log at {LINES_PER_S} lines/s: {100 * follow_cpu / follow_wall:.2f} % of a core",
    ]
    idle = Side(f"sidecar CPU seconds over {idle_wall:.1f} s idle, {n:,} claims")
    idle.runs.append(Timing(idle_cpu))
    rss = Side("sidecar RSS, MiB (most seen while idle)")
    rss.runs.append(Timing(rss_max / (1 << 20)))
    follow = Side(f"sidecar CPU seconds over {follow_wall:.1f} s, a job logging {LINES_PER_S} lines/s")
    follow.runs.append(Timing(follow_cpu))
    figures = [
        (
            f"{KEY}-idle-cpu",
            f"idle sidecar CPU, {n:,} claims",
            idle,
            budget("1 % of a core", IDLE_BUDGET * idle_wall),
        ),
        (f"{KEY}-idle-rss", f"idle sidecar RSS (MiB), {n:,} claims", rss, budget("80 MiB", RSS_BUDGET_MIB)),
        (
            f"{KEY}-follow-cpu",
            f"sidecar CPU following {LINES_PER_S} log lines/s",
            follow,
            budget("5 % of a core", FOLLOW_BUDGET * follow_wall),
        ),
    ]
    return [
        FigureResult(key, title, ours, b, "time", 1.0, 0, notes=notes if i == 0 else [])
        for i, (key, title, ours, b) in enumerate(figures)
    ]


def _step(stub: sidecar_pb2_grpc.SidecarStub, job_id: str) -> int:
    return next((j.progress.step for j in _health(stub).jobs if j.id == job_id), 0)
