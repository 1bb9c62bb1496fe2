"""Figure: a training loop's step time while a real sidecar pushes a checkpoint, vs without one.

The trainer is one process that runs until told to stop: a small torch model on the CPU (an MLP,
SGD, ~10 ms a step), with TRAINER_THREADS torch threads (1 by default: the host thread that drives
a GPU; `$BOXWARDEN_BENCH_TRAINER_THREADS=2` fills both cores of a 2-core machine), reporting when
each of its steps began and ended. The box is a real sidecar (`python -m sidecar`, default settle,
health and rescan intervals) watching a directory and pushing to `file://` on the same disk.

Each run is two windows of the same trainer process, in alternating order:

The sidecar runs with its defaults, its push rate (`sidecar.storage.pace`) included: the rate is
what keeps a push from taking the trainer's memory bandwidth (full speed cost 10-25 % here).

- ours: the checkpoint (the shared `size`-byte source, hot in the page cache as a file the trainer
  has just written) is hard-linked into the watched directory; the window runs from the end of the
  sidecar's settle time to the moment its claim is durable (staged, committed, re-read and proven).
- baseline: the sidecar is stopped (SIGSTOP: it takes no CPU and does no I/O), for as long as the
  last push took.

Per window: the mean time of the steps that began and ended inside it; per side: the median over
the runs; the ratio ours/baseline, target ≤ 1.05. Between windows the durable copy is removed (the
disk holds one at a time) and the trainer runs on for GAP_S.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, Context, FigureResult, Side, Timing, make_hot, quiesce
from sidecar.storage.pace import DEFAULT_RATE

logger = logging.getLogger(__name__)

KEY = "train-step"
TITLE = "trainer step time during a push"
TARGET = 1.05  # ≤ 1.05× the step time without the sidecar
SETTLE_MS = 200  # the sidecar's default
GAP_S = 0.5
WARMUP_S = 2.0
POLL_S = 0.25  # how often the bench asks the sidecar whether the claim is durable (its answer is exact)
PUSH_TIMEOUT_S = 120.0


def _threads() -> int:
    return int(os.environ.get("BOXWARDEN_BENCH_TRAINER_THREADS", "1"))


def run(ctx: Context) -> FigureResult:
    from tests.sidecar.daemon import running  # the sidecar's own test harness: a real daemon

    src = ctx.source_file()
    root = ctx.work_dir / "trainbox"
    threads = _threads()
    o, b = Side(f"trainer ({threads} thread) while the sidecar pushes"), Side("trainer, sidecar stopped")
    steps: list[tuple[int, int]] = []
    windows: list[tuple[Side, int, int]] = []
    with running(root, settle_ms=SETTLE_MS, health_interval_ms=1000, rescan_ms=10_000) as box:
        assert box.proc is not None
        pid = box.proc.pid
        trainer = _start_trainer(threads)
        try:
            time.sleep(WARMUP_S)
            last_push_s = 0.0

            def ours(i: int) -> None:
                nonlocal last_push_s
                w0, w1 = _push(box, src, f"ckpt-{i}.bin")
                windows.append((o, w0, w1))
                last_push_s = (w1 - w0) / 1e9

            def baseline() -> None:
                make_hot(src)
                quiesce()
                os.kill(pid, signal.SIGSTOP)
                try:
                    w0 = time.time_ns()
                    time.sleep(last_push_s)
                    w1 = time.time_ns()
                finally:
                    os.kill(pid, signal.SIGCONT)
                windows.append((b, w0, w1))

            for r in range(ctx.runs):
                if r == 0 or r % 2:  # the first baseline needs a push's length
                    ours(r)
                    time.sleep(GAP_S)
                    baseline()
                else:
                    baseline()
                    time.sleep(GAP_S)
                    ours(r)
                time.sleep(GAP_S)
                print(f"  run {r + 1}/{ctx.runs}: push {last_push_s:.3f} s", file=sys.stderr)
        finally:
            steps = _stop_trainer(trainer)
    for side, w0, w1 in windows:
        inside = [(e - s) / 1e9 for s, e in steps if s >= w0 and e <= w1]
        if len(inside) < 10:
            raise RuntimeError(f"{KEY}: only {len(inside)} trainer steps in a {(w1 - w0) / 1e9:.2f} s window")
        side.runs.append(Timing(statistics.mean(inside), {"window": (w1 - w0) / 1e9}))
    notes = [
        f"trainer: torch MLP on the CPU, {threads} thread(s); {os.cpu_count()} CPUs",
        f"the sidecar at its default push rate, {DEFAULT_RATE / 1e6:g} MB/s (up --push-rate)",
        f"push (settle end → durable) median {statistics.median(t.parts['window'] for t in o.runs):.3f} s",
    ]
    return FigureResult(KEY, TITLE, o, b, "time", TARGET, ctx.size, notes=notes)


def _push(box: Any, src: Path, name: str) -> tuple[int, int]:
    """Put the checkpoint in the watched directory; the window (Unix ns) from the end of the
    settle time to the claim's durable time. Then remove the link and the durable copy."""
    make_hot(src)
    quiesce()
    link = box.watch / name
    os.link(src, link)
    start = time.time_ns() + SETTLE_MS * 1_000_000
    deadline = time.monotonic() + PUSH_TIMEOUT_S
    durable_at = 0
    while not durable_at:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{KEY}: {name} not durable after {PUSH_TIMEOUT_S:.0f} s: {box.claims()}")
        time.sleep(POLL_S)
        for c in box.claims():
            if c.path.endswith(name):
                if c.push_error:
                    raise RuntimeError(f"{KEY}: pushing {name} failed: {c.push_error}")
                durable_at = c.durable_at_unix_ns
    link.unlink()
    for copy in box.durable.rglob(name):
        copy.unlink()
    return start, durable_at


def _start_trainer(threads: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.trainstep", "--threads", str(threads)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{KEY}: the trainer did not start (exit {proc.returncode})")
    return proc


def _stop_trainer(proc: subprocess.Popen[str]) -> list[tuple[int, int]]:
    """Tell the trainer to stop (close its stdin); its steps as (began, ended) in Unix ns."""
    out, _ = proc.communicate(timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{KEY}: the trainer exited {proc.returncode}")
    flat = json.loads(out)
    return list(zip(flat[::2], flat[1::2], strict=True))


def train(threads: int) -> None:
    """The trainer: steps until stdin closes, then prints every step's (began, ended) as JSON."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(128, 512), torch.randn(128, 512)
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    print("ready", flush=True)
    flat: list[int] = []
    while not stop.is_set():
        t0 = time.time_ns()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        flat += (t0, time.time_ns())
    sys.stdout.write(json.dumps(flat))


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.trainstep", description="the bench's trainer")
    p.add_argument("--threads", type=int, default=1)
    train(p.parse_args().threads)
