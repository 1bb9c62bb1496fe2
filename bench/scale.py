"""Figure: the scale acceptance check — N small real files (100,000 by default) on a real box.

A box is brought up through the real CLI (`up --profile local`, its own $BOXWARDEN_HOME) and its
real sidecar seals every file. Measured, each against its budget (the "baseline" column is the
budget, so the ratio is the share of it used; ≤ 1 passes):

- burst: 2,000 small files at once while Hello and ListArtifacts are asked in a loop; the slowest
  answer against the controller's RPC deadline (a query must never time out during a burst);
- seal: the remaining files → all N durable (sealing rate in files/s), budget 15 min;
- idle: the sidecar's CPU over ~10 s with nothing to do, budget 1 % of a core (RSS in the notes);
- `artifacts NAME --json`, median of 3, budget 5 s;
- `pull` and `verify` once (timed, in the notes), then `down NAME --dry-run`, median of 3, budget 20 s.

Every command must exit as expected (the gate must allow the dry run), and no output may mention
DEADLINE_EXCEEDED or an unreachable sidecar. Everything started here is stopped by PID (SIGTERM).

N: $BOXWARDEN_BENCH_SCALE_N (default 100000); the idle window: $BOXWARDEN_BENCH_SCALE_IDLE_S.
Run only this figure: `python -m bench scale` (or `--only scale`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from boxwarden_pb.v1 import sidecar_pb2 as pb
from boxwarden_pb.v1 import sidecar_pb2_grpc

from bench.common import (
    CODE_PATH,
    Context,
    FigureResult,
    Side,
    Timing,
    budget,
    clock,
    proc_cpu_s,
    proc_rss_bytes,
    stop_pid,
)

logger = logging.getLogger(__name__)

KEY = "scale"
BOX = "scale"
BURST = 2_000
PER_DIR = 1_000
FILE_BYTES = 256
ARTIFACTS_BUDGET_S = 5.0
DOWN_BUDGET_S = 20.0
SEAL_BUDGET_S = 15 * 60.0
IDLE_BUDGET = 0.01  # of one core
RPC_DEADLINE_S = 10.0  # the controller's unary deadline (controller.client.SidecarClient)
RUNS = 3
BAD_WORDS = ("DEADLINE_EXCEEDED", "unreachable")


def _n_files() -> int:
    n = int(os.environ.get("BOXWARDEN_BENCH_SCALE_N", "100000"))
    if n <= BURST:
        raise SystemExit(f"BOXWARDEN_BENCH_SCALE_N must be more than the burst of {BURST}")
    return n


@dataclass
class _Box:
    """The CLI with its own state home, and what it started."""

    home: Path
    cwd: Path
    log: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "BOXWARDEN_HOME": str(self.home),
            "PYTHONPATH": CODE_PATH,
            "COLUMNS": "200",
        }

    def cli(self, *args: str, expect: int = 0, timeout: float = 3600) -> tuple[float, str]:
        """Run `boxwarden ARGS`; (seconds, stdout). Any other exit status, or an output that mentions
        a missed deadline or an unreachable sidecar, fails the figure."""
        t0 = clock()
        proc = subprocess.run(
            [sys.executable, "-m", "controller", *args],
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        took = clock() - t0
        shown = f"boxwarden {' '.join(args)}"
        if proc.returncode != expect:
            raise RuntimeError(
                f"{KEY}: {shown} exited {proc.returncode}, expected {expect}:\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        for word in BAD_WORDS:
            for stream in (proc.stdout, proc.stderr):
                if word.lower() in stream.lower():
                    at = stream.lower().index(word.lower())
                    raise RuntimeError(
                        f"{KEY}: {shown} mentions {word}: …{stream[max(0, at - 300) : at + 300]}…"
                    )
        self.log.append(f"{shown}: {took:.3f} s")
        print(f"  {shown}: {took:.3f} s", file=sys.stderr)
        return took, proc.stdout

    @property
    def box_dir(self) -> Path:
        return self.home / "boxes" / BOX

    def socket(self) -> str:
        from controller import bootstrap

        return f"unix:{bootstrap.socket_path_for(self.box_dir)}"

    def sidecar_pid(self) -> int | None:
        try:
            return int((self.box_dir / "sidecar" / "sidecar.pid").read_text().strip())
        except (OSError, ValueError):
            return None


def _write_files(watch: Path, start: int, stop: int) -> int:
    """Files start..stop-1, PER_DIR per directory; returns the bytes written."""
    total = 0
    for i in range(start, stop):
        d = watch / f"d{i // PER_DIR:04d}"
        if i % PER_DIR == 0 or i == start:
            d.mkdir(exist_ok=True)
        data = f"{i:08d}\n".encode() + os.urandom(FILE_BYTES - 9)
        with open(d / f"f{i:07d}.bin", "wb") as f:
            f.write(data)
        total += len(data)
    return total


def _stub(target: str) -> tuple[grpc.Channel, sidecar_pb2_grpc.SidecarStub]:
    """A plain (synchronous) channel: usable from any thread, unlike a grpc.aio one."""
    opts = [("grpc.max_receive_message_length", 8 << 20)]
    channel = grpc.insecure_channel(target, options=opts)
    return channel, sidecar_pb2_grpc.SidecarStub(channel)


def _durable_count(stub: sidecar_pb2_grpc.SidecarStub) -> tuple[int, int]:
    """(sealed, durable) from one health snapshot: counters, no scan of the claims."""
    for snap in stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=60):
        return snap.artifacts.sealed, snap.artifacts.durable
    raise RuntimeError(f"{KEY}: WatchHealth sent no snapshot")


def _list_all(stub: sidecar_pb2_grpc.SidecarStub, timeout: float) -> int:
    """Every page of one listing, as the controller asks for it; returns the number of claims."""
    token, claims = "", 0
    while True:
        page = stub.ListArtifacts(pb.ListArtifactsRequest(page_token=token), timeout=timeout)
        claims += len(page.claims)
        token = page.next_page_token
        if not token:
            return claims


def _wait_durable(stub: sidecar_pb2_grpc.SidecarStub, n: int, budget_s: float) -> float:
    """Seconds until n claims are durable (polled every 0.5 s); fails the figure past budget_s."""
    t0 = clock()
    last_print = t0
    while True:
        sealed, durable = _durable_count(stub)
        now = clock()
        if durable >= n:
            return now - t0
        if now - last_print >= 15:
            rate = durable / (now - t0) if now > t0 else 0.0
            print(f"  … {sealed} sealed, {durable}/{n} durable ({rate:.0f} files/s so far)", file=sys.stderr)
            last_print = now
        if now - t0 > budget_s:
            raise RuntimeError(f"{KEY}: only {durable}/{n} durable after {budget_s:.0f} s (sealed {sealed})")
        time.sleep(0.5)


class _Prober:
    """Asks Hello and ListArtifacts in a loop, from its own thread, and records how long each took.
    Its deadline is far beyond the controller's, so a slow answer is measured rather than lost."""

    def __init__(self, stub: sidecar_pb2_grpc.SidecarStub) -> None:
        self._stub = stub
        self._stop = threading.Event()
        self.hello: list[float] = []
        self.listing: list[float] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> _Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=300)

    def _loop(self) -> None:
        calls: tuple[tuple[str, Callable[[], object], list[float]], ...] = (
            ("Hello", lambda: self._stub.Hello(pb.HelloRequest(), timeout=120), self.hello),
            ("ListArtifacts", lambda: _list_all(self._stub, 120), self.listing),
        )
        while not self._stop.is_set():
            for what, call, into in calls:
                t0 = clock()
                try:
                    call()
                except grpc.RpcError as e:
                    self.errors.append(f"{what}: {e}")
                into.append(clock() - t0)
            self._stop.wait(0.05)


def run(ctx: Context) -> list[FigureResult]:
    n = _n_files()
    idle_s = float(os.environ.get("BOXWARDEN_BENCH_SCALE_IDLE_S", "10"))
    base = ctx.work_dir / "scale"
    box = _Box(home=base / "home", cwd=base / "work")
    box.cwd.mkdir(parents=True)
    watch = box.cwd / "ckpt"
    watch.mkdir()
    pid: int | None = None
    print(f"  {n:,} files of {FILE_BYTES} bytes, {PER_DIR} per directory, in {watch}", file=sys.stderr)
    try:
        box.cli("up", BOX, "--profile", "local", "--workdir", str(box.cwd), "--watch", "ckpt", timeout=300)
        pid = box.sidecar_pid()
        if pid is None:
            raise RuntimeError(f"{KEY}: `up` left no sidecar.pid in {box.box_dir}")
        channel, stub = _stub(box.socket())

        # 1. A burst of small files while queries keep coming.
        with _Prober(stub) as prober:
            t0 = clock()
            total_bytes = _write_files(watch, 0, BURST)
            burst_s = _wait_durable(stub, BURST, SEAL_BUDGET_S)
            burst_written_s = clock() - t0
        worst_hello = max(prober.hello, default=0.0)
        worst_list = max(prober.listing, default=0.0)
        print(
            f"  burst: {BURST} files durable in {burst_written_s:.1f} s; slowest Hello {worst_hello:.3f} s, "
            f"ListArtifacts {worst_list:.3f} s ({len(prober.hello)} + {len(prober.listing)} asked)",
            file=sys.stderr,
        )
        if prober.errors:
            raise RuntimeError(f"{KEY}: queries failed during the burst: {prober.errors[:5]}")

        # 2. The rest, as fast as this process can write them.
        t0 = clock()
        total_bytes += _write_files(watch, BURST, n)
        written_s = clock() - t0
        seal_s = written_s + _wait_durable(stub, n, SEAL_BUDGET_S)
        rate = (n - BURST) / seal_s
        print(
            f"  sealed: {n - BURST:,} files written in {written_s:.1f} s, all {n:,} durable after "
            f"{seal_s:.1f} s ({rate:.0f} files/s)",
            file=sys.stderr,
        )

        # 3. Idle: nothing is written; what does the sidecar cost?
        time.sleep(2.0)  # let the last notifications drain
        cpu0, w0 = proc_cpu_s(pid), clock()
        time.sleep(idle_s)
        idle_cpu, idle_wall = proc_cpu_s(pid) - cpu0, clock() - w0
        rss = proc_rss_bytes(pid)
        print(
            f"  idle: {100 * idle_cpu / idle_wall:.2f} % of a core over {idle_wall:.1f} s, "
            f"RSS {rss / (1 << 20):.0f} MiB",
            file=sys.stderr,
        )

        # 4. The controller's commands.
        art = Side("boxwarden artifacts NAME --json")
        for _ in range(RUNS):
            took, out = box.cli("artifacts", BOX, "--json")
            doc = json.loads(out)
            claims = doc.get("claims", [])
            durable = sum(bool(c.get("durable")) for c in claims)
            pending = len(doc.get("pending", []))
            if len(claims) != n or durable != n or pending:
                raise RuntimeError(
                    f"{KEY}: artifacts listed {len(claims)} claims ({durable} durable) and {pending} "
                    f"pending; expected {n} durable, none pending"
                )
            art.runs.append(Timing(took))
        pulled = base / "pulled"
        pull_s, _ = box.cli("pull", BOX, "--to", str(pulled))
        verify_s, _ = box.cli("verify", str(pulled))
        down = Side("boxwarden down NAME --dry-run")
        for _ in range(RUNS):
            took, _ = box.cli("down", BOX, "--dry-run")
            down.runs.append(Timing(took))
        channel.close()
    finally:
        stop_pid(pid if pid is not None else box.sidecar_pid())
        shutil.rmtree(base, ignore_errors=True)

    label = f"{n:,} files"
    notes = [
        f"sealing rate: {rate:.0f} files/s ({n - BURST:,} files in {seal_s:.1f} s, from the first write)",
        f"burst: {BURST} files durable {burst_s:.1f} s after the last write; slowest Hello "
        f"{worst_hello:.3f} s, slowest ListArtifacts {worst_list:.3f} s "
        f"(median {statistics.median(prober.listing or [0.0]):.3f} s, {len(prober.listing)} asked)",
        f"idle: {100 * idle_cpu / idle_wall:.2f} % of a core over {idle_wall:.1f} s; "
        f"RSS {rss / (1 << 20):.1f} MiB",
        f"pull {pull_s:.1f} s, verify {verify_s:.1f} s",
        *box.log,
    ]
    burst_side = Side("slowest Hello/ListArtifacts during the burst")
    burst_side.runs.append(
        Timing(max(worst_hello, worst_list), {"Hello": worst_hello, "ListArtifacts": worst_list})
    )
    idle_side = Side(f"sidecar CPU seconds over {idle_wall:.1f} s idle")
    idle_side.runs.append(Timing(idle_cpu))
    seal_side = Side(f"write {n - BURST:,} files → all durable")
    seal_side.runs.append(Timing(seal_s))
    figures = [
        (
            f"{KEY}-burst",
            f"query latency during a {BURST}-file burst",
            burst_side,
            budget("the controller's RPC deadline", RPC_DEADLINE_S),
        ),
        (f"{KEY}-seal", f"seal {label} → durable", seal_side, budget("15 min", SEAL_BUDGET_S)),
        (
            f"{KEY}-idle-cpu",
            f"idle sidecar CPU, {label}",
            idle_side,
            budget("1 % of a core", IDLE_BUDGET * idle_wall),
        ),
        (f"{KEY}-artifacts", f"artifacts --json, {label}", art, budget("5 s", ARTIFACTS_BUDGET_S)),
        (f"{KEY}-down-dry-run", f"down --dry-run, {label}", down, budget("20 s", DOWN_BUDGET_S)),
    ]
    return [
        FigureResult(key, title, ours, budget, "time", 1.0, total_bytes, notes=notes if i == 0 else [])
        for i, (key, title, ours, budget) in enumerate(figures)
    ]
