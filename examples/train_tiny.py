"""A tiny CPU training loop that checkpoints atomically and resumes: the demo workload.

It owns nothing but its own output directory. Every file it publishes there (step checkpoints
`ckpt-<step:06d>.pt`, `best.pt`, `metrics.json`) is written tmp → flush → fsync → rename → fsync dir,
so a watcher only ever sees complete files under their final names. On start it resumes from the
newest checkpoint that loads with `weights_only=True`; corrupt ones are skipped. SIGTERM finishes the
current step, saves a checkpoint and exits 143 so a supervisor can tell it was terminated.

    python examples/train_tiny.py --out .demo/watched/cell-a --steps 200 --save-every 50
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

CKPT_RE = re.compile(r"^ckpt-(\d{6,})\.pt$")
TMP_SUFFIX = ".tmp"
N_FEATURES = 8
N_SAMPLES = 1024
BATCH = 64
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # finish the step, save, exit 128 + signum


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:06d}.pt"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(dest: Path, write: Callable[[BinaryIO], object]) -> None:
    """Publish `dest` only once its bytes are on disk: a reader never sees a partial file under its name."""
    tmp = dest.with_name(dest.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest.parent)


def save_torch(dest: Path, obj: dict[str, Any]) -> None:
    write_atomic(dest, lambda f: torch.save(obj, f))


def save_json(dest: Path, obj: dict[str, Any]) -> None:
    data = (json.dumps(obj, sort_keys=True, indent=2) + "\n").encode()
    write_atomic(dest, lambda f: f.write(data))


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data; a private generator keeps it identical across resumes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    w = torch.randn(N_FEATURES, 1, generator=g)
    noise = 0.01 * torch.randn(N_SAMPLES, 1, generator=g)
    y = torch.sin(x @ w / N_FEATURES**0.5) + 0.1 * x[:, :1] ** 2 + noise
    return x, y


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(N_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
    )


def load_checkpoint(path: Path) -> dict[str, Any]:
    ckpt = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("step"), int):
        raise ValueError("not a train_tiny checkpoint")
    return ckpt


def checkpoints_newest_first(out: Path) -> list[tuple[int, Path]]:
    found = []
    for p in out.iterdir():
        m = CKPT_RE.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found, reverse=True)


RESUME_ENV = "BOXWARDEN_RESUME_FROM"


def find_resume(out: Path) -> tuple[dict[str, Any], Path] | None:
    """The checkpoint the boxwarden sidecar names in $BOXWARDEN_RESUME_FROM when it restarts this
    job (its newest durable one), if it loads; else the newest checkpoint in `out` that loads.
    Unreadable ones are reported and skipped, never deleted."""
    named = os.environ.get(RESUME_ENV)
    if named:
        try:
            return load_checkpoint(Path(named)), Path(named)
        except Exception as exc:
            print(f"{RESUME_ENV}={named} does not load ({type(exc).__name__}: {exc})", file=sys.stderr)
    for _, path in checkpoints_newest_first(out):
        try:
            return load_checkpoint(path), path
        except Exception as exc:
            print(f"skipping unloadable checkpoint {path.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return None


def remove_stale_tmp(out: Path) -> None:
    """A crash mid-save leaves our own tmp files behind; they were never published, so drop them."""
    for p in out.iterdir():
        if p.name.endswith(TMP_SUFFIX) and (
            CKPT_RE.match(p.name[: -len(TMP_SUFFIX)]) or p.name in ("best.pt.tmp", "metrics.json.tmp")
        ):
            p.unlink(missing_ok=True)


def finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Tiny CPU training loop that checkpoints atomically and resumes."
    )
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory (e.g. <watched>/cell-a)")
    ap.add_argument("--steps", type=int, default=200, help="total optimizer steps (default 200)")
    ap.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (default 50)")
    ap.add_argument("--log-every", type=int, default=10, help="print progress every N steps (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--hidden", type=int, default=64, help="model width (default 64)")
    ap.add_argument("--step-delay-s", type=float, default=0.0, help="sleep after each step, for demos")
    args = ap.parse_args(argv)
    if min(args.steps, args.save_every, args.log_every, args.hidden) < 1:
        ap.error("--steps, --save-every, --log-every and --hidden must be >= 1")
    if args.step_delay_s < 0:
        ap.error("--step-delay-s must be >= 0")
    return args


def incompatible(ckpt: dict[str, Any], args: argparse.Namespace) -> str | None:
    """Why this checkpoint cannot seed this run, or None: resuming another model would be a silent restart."""
    made = (ckpt.get("hidden"), ckpt.get("seed"))
    if made == (args.hidden, args.seed):
        return None
    return f"made with hidden={made[0]} seed={made[1]}, not hidden={args.hidden} seed={args.seed}"


@dataclass
class Run:
    """One training run in one output directory: model, optimizer and the best-so-far bookkeeping."""

    args: argparse.Namespace
    x: torch.Tensor
    y: torch.Tensor
    model: nn.Module
    opt: torch.optim.Optimizer
    step: int = 0
    loss: float = math.nan
    resumed_from: int | None = None
    best_loss: float = math.inf
    best_step: int | None = None
    best_weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def out(self) -> Path:
        return Path(self.args.out)

    def resume(self, ckpt: dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt["model_state_dict"])
        self.opt.load_state_dict(ckpt["optimizer_state_dict"])
        torch.set_rng_state(ckpt["torch_rng_state"])
        random.setstate(ckpt["python_random_state"])
        self.step = self.resumed_from = ckpt["step"]
        self.loss = ckpt["loss"]
        self.best_loss, self.best_step = ckpt["best_loss"], ckpt["best_step"]
        if self.best_step is None:
            return
        try:
            best = (
                ckpt if self.best_step == self.step else load_checkpoint(self.out / ckpt_name(self.best_step))
            )
            self.best_weights = best["model_state_dict"]
        except Exception as exc:
            # The best checkpoint is gone or broken: track the best again from here.
            print(f"best step {self.best_step} unusable ({exc}); tracking best anew", file=sys.stderr)
            self.best_loss, self.best_step = math.inf, None

    def evaluate(self) -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(self.model(self.x), self.y))

    def train_step(self) -> float:
        idx = torch.randint(0, N_SAMPLES, (BATCH,))
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(self.x[idx]), self.y[idx])
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.step += 1
        return float(loss.detach())

    def save(self) -> None:
        self.loss = self.evaluate()
        if self.loss < self.best_loss:
            self.best_loss, self.best_step = self.loss, self.step
            # state_dict() tensors alias the live parameters: keep a copy.
            self.best_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        ckpt = {
            "model_state_dict": self.model.state_dict(),
            "optimizer_state_dict": self.opt.state_dict(),
            "step": self.step,
            "loss": self.loss,
            "best_loss": self.best_loss,
            "best_step": self.best_step,
            "torch_rng_state": torch.get_rng_state(),
            "python_random_state": random.getstate(),
            "seed": self.args.seed,
            "hidden": self.args.hidden,
        }
        save_torch(self.out / ckpt_name(self.step), ckpt)
        print(f"saved {ckpt_name(self.step)} loss {self.loss:.4f}", flush=True)

    def finish(self, steps_per_s: float | None) -> None:
        if self.best_weights is not None:
            # Weights only: optimizer and RNG state would describe a later step than best_step.
            best = {
                "model_state_dict": self.best_weights,
                "step": self.best_step,
                "loss": self.best_loss,
                "best_loss": self.best_loss,
                "best_step": self.best_step,
                "seed": self.args.seed,
                "hidden": self.args.hidden,
            }
            save_torch(self.out / "best.pt", best)
        metrics = {
            "step": self.step,
            "loss": finite_or_none(self.loss),
            "best_loss": finite_or_none(self.best_loss),
            "best_step": self.best_step,
            "steps_per_s": steps_per_s,
            "resumed_from": self.resumed_from,
        }
        save_json(self.out / "metrics.json", metrics)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(args.out)

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)

    # Decide before building the optimizer (its first use imports torch._dynamo, about a second).
    found = find_resume(args.out)
    if found is not None:
        ckpt, path = found
        if why := incompatible(ckpt, args):
            print(f"error: {path.name} was {why}; use another --out", file=sys.stderr)
            return 2
        if ckpt["step"] >= args.steps:
            print(f"already finished: {path.name} is at step {ckpt['step']} >= {args.steps}", flush=True)
            return 0

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    x, y = make_data(args.seed)
    model = make_model(args.hidden)
    run = Run(args, x, y, model, torch.optim.Adam(model.parameters(), lr=args.lr))
    if found is not None:
        run.resume(found[0])
        print(f"resumed from {found[1].name} at step {run.step}", flush=True)

    start_step, t0 = run.step, time.perf_counter()
    while run.step < args.steps and not stop.is_set():
        batch_loss = run.train_step()
        if run.step % args.log_every == 0 or run.step == args.steps:
            print(f"step {run.step}/{args.steps} loss {batch_loss:.4f}", flush=True)
        if run.step % args.save_every == 0 or run.step == args.steps:
            run.save()
        if args.step_delay_s:
            stop.wait(args.step_delay_s)  # returns at once on SIGTERM
    elapsed = time.perf_counter() - t0

    if run.step < args.steps:  # stopped by a signal
        if run.step > start_step and run.step % args.save_every != 0:
            run.save()
        print(f"terminated by signal {received[0]} at step {run.step}", file=sys.stderr, flush=True)
        return 128 + received[0]

    run.finish((run.step - start_step) / elapsed if elapsed > 0 else None)
    print(
        f"done: step {run.step} loss {run.loss:.4f} best {run.best_loss:.4f} at step {run.best_step}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
