"""Figure: one controller watching a fleet — 64 real sidecars (local processes) streaming health at
1 Hz to one `watch` (controller.watchview, in this process, drawing its 80-column table each second
as the live view does) for 60 s.

- the controller's CPU over the window, against 20 % of one core;
- the event latency, from a snapshot's sampling on its box to its receipt by the controller: the
  99th percentile over every snapshot of the window, against 1 s;
- the sidecars' total CPU is reported too (a note).

Sidecars: $BOXWARDEN_BENCH_FLEET_N (default 64); window: $BOXWARDEN_BENCH_FLEET_S (default 60).
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb
from google.protobuf import json_format

from bench.common import Context, FigureResult, Side, Timing, budget, clock, proc_cpu_s, start_sidecar

KEY = "fleet"
CPU_BUDGET = 0.20  # of one core
LATENCY_P99_S = 1.0
READY_S = 600.0


def _start(base: Path, sock_dir: Path, i: int) -> tuple[subprocess.Popen[bytes], pb.SidecarConfig]:
    d = base / f"box{i:02d}"
    watch, durable = d / "watch", d / "durable"
    watch.mkdir(parents=True)
    durable.mkdir()
    msg = pb.SidecarConfig(
        box_name=f"box{i:02d}",
        profile="local",
        state_dir=str(d / "state"),
        socket_path=str(sock_dir / f"{i:02d}.sock"),
        watch_dirs=[str(watch)],
        durable_url=durable.as_uri(),
        gpu_probe="none",
        run_id="bench",
    )
    config = d / "sidecar.json"
    config.write_text(json_format.MessageToJson(msg))
    return start_sidecar(config, d / "sidecar.log"), msg


def run(ctx: Context) -> list[FigureResult]:
    from rich.console import Console

    from controller import watchview
    from controller.state import Box, State

    n = int(os.environ.get("BOXWARDEN_BENCH_FLEET_N", "64"))
    window = float(os.environ.get("BOXWARDEN_BENCH_FLEET_S", "60"))
    base = ctx.work_dir / "fleet"
    sock_dir = Path(tempfile.mkdtemp(prefix="bwf-", dir="/tmp"))
    state = State(base / "home")
    started: list[tuple[subprocess.Popen[bytes], pb.SidecarConfig]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(n):
            started.append(_start(base, sock_dir, i))
            procs.append(started[-1][0])
        for _, msg in started:
            state.put(
                Box(
                    name=msg.box_name,
                    profile="local",
                    box_dir=str(Path(msg.state_dir).parent),
                    state_dir=msg.state_dir,
                    socket=msg.socket_path,
                    workdir=str(Path(msg.state_dir).parent),
                    watch=tuple(msg.watch_dirs),
                    durable=msg.durable_url,
                    run_id=msg.run_id,
                )
            )
        seen = [watchview.Seen(state.get(msg.box_name)) for _, msg in started]
        out = Console(file=io.StringIO(), width=80)
        result: dict[str, float] = {}

        async def measure() -> None:
            def show(t: object, alerts: list[str]) -> None:
                out.print(t)  # the live view's work: the table drawn each interval
                out.file = io.StringIO()

            task = asyncio.create_task(watchview.run(state, seen, "", interval_s=1.0, once=False, show=show))
            deadline = clock() + READY_S
            while any(not s.at for s in seen):
                if clock() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"{KEY}: not every sidecar answered; see {base}/box*/sidecar.log")
                await asyncio.sleep(0.5)
            await asyncio.sleep(5.0)  # every stream up and steady
            for s in seen:
                s.lags.clear()
            side0 = sum(proc_cpu_s(p.pid) for p in procs)
            cpu0, w0 = time.process_time(), clock()
            await asyncio.sleep(window)
            result["cpu"], result["wall"] = time.process_time() - cpu0, clock() - w0
            result["sidecars"] = sum(proc_cpu_s(p.pid) for p in procs) - side0
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(measure())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)

    lags = sorted(x for s in seen for x in s.lags)
    if len(lags) < 0.8 * n * window:
        raise RuntimeError(f"{KEY}: only {len(lags)} snapshots from {n} sidecars in {window:.0f} s")
    p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
    wall = result["wall"]
    notes = [
        f"{n} sidecars, {len(lags)} snapshots in {wall:.1f} s: controller {100 * result['cpu'] / wall:.1f} % "
        f"of a core; latency median {statistics.median(lags) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
        f"max {lags[-1] * 1000:.0f} ms",
        f"the {n} sidecars together: {100 * result['sidecars'] / wall:.1f} % of a core",
    ]
    print(f"  {notes[0]}\n  {notes[1]}", file=sys.stderr)
    cpu = Side(f"controller CPU seconds over {wall:.1f} s watching {n} sidecars")
    cpu.runs.append(Timing(result["cpu"]))
    lat = Side("event latency p99, seconds (snapshot sampled on the box -> received)")
    lat.runs.append(Timing(p99))
    return [
        FigureResult(
            f"{KEY}-controller-cpu",
            f"controller CPU, watch of {n} sidecars",
            cpu,
            budget("20 % of a core", CPU_BUDGET * wall),
            "time",
            1.0,
            0,
            notes=notes,
        ),
        FigureResult(
            f"{KEY}-latency-p99",
            f"event latency p99, {n} sidecars",
            lat,
            budget("1 s", LATENCY_P99_S),
            "time",
            1.0,
            0,
        ),
    ]
