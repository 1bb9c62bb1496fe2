"""examples/train_tiny.py: atomic checkpoints, resume from the newest loadable one, SIGTERM saves first.

Every run is a real subprocess of the interpreter running pytest (the project venv), and every
checkpoint is opened the way the sidecar's load probe opens it: weights only, no pickle execution.
"""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from tests.conftest import built_once

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_tiny.py"
RUN_TIMEOUT_S = 120


def train(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def train_ok(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = train(out, *args)
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def load(path: Path) -> dict[str, Any]:
    ckpt = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    assert isinstance(ckpt, dict)
    return ckpt


def metrics(out: Path) -> dict[str, Any]:
    data = json.loads((out / "metrics.json").read_text())
    assert isinstance(data, dict)
    return data


def ckpt_steps(out: Path) -> list[int]:
    return sorted(int(p.name[len("ckpt-") : -len(".pt")]) for p in out.glob("ckpt-*.pt"))


def snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())}


def assert_same_weights(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert torch.equal(v, b[k]), k


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 200-step run, shared read-only by the tests below (and made once for the
    session: xdist workers that run them share it)."""
    run = built_once(
        tmp_path_factory,
        "train-tiny-full",
        lambda d: train_ok(d / "cell-a", "--steps", "200", "--save-every", "50"),
    )
    return run / "cell-a"


def test_fresh_run_publishes_loadable_checkpoints(full_run: Path) -> None:
    assert ckpt_steps(full_run) == [50, 100, 150, 200]
    assert {p.name for p in full_run.iterdir()} == {
        "ckpt-000050.pt",
        "ckpt-000100.pt",
        "ckpt-000150.pt",
        "ckpt-000200.pt",
        "best.pt",
        "metrics.json",
    }, "no *.tmp may be left behind"
    for step in ckpt_steps(full_run):
        ckpt = load(full_run / f"ckpt-{step:06d}.pt")
        assert ckpt["step"] == step
        assert {"model_state_dict", "optimizer_state_dict", "loss", "best_loss"} <= ckpt.keys()
        assert isinstance(ckpt["torch_rng_state"], torch.Tensor)
        assert ckpt["torch_rng_state"].dtype == torch.uint8
        assert isinstance(ckpt["python_random_state"], tuple)

    m = metrics(full_run)
    assert m["step"] == 200
    assert m["resumed_from"] is None
    assert m["steps_per_s"] > 0
    assert m["best_loss"] <= m["loss"]
    first = load(full_run / "ckpt-000050.pt")["loss"]
    assert m["best_loss"] < first, "the loop should actually learn"

    best = load(full_run / "best.pt")
    assert best["step"] == m["best_step"]
    assert best["loss"] == m["best_loss"]
    assert_same_weights(
        best["model_state_dict"], load(full_run / f"ckpt-{best['step']:06d}.pt")["model_state_dict"]
    )


def test_resume_continues_exactly(full_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "cell-a"
    train_ok(out, "--steps", "100", "--save-every", "50")
    assert metrics(out)["step"] == 100

    proc = train_ok(out, "--steps", "200", "--save-every", "50")
    assert "resumed from ckpt-000100.pt at step 100" in proc.stdout
    m = metrics(out)
    assert (m["resumed_from"], m["step"]) == (100, 200)
    assert ckpt_steps(out) == [50, 100, 150, 200]
    # Model, optimizer and RNG state all came back: 100 + 100 steps equal 200 in one go.
    assert_same_weights(
        load(out / "ckpt-000200.pt")["model_state_dict"],
        load(full_run / "ckpt-000200.pt")["model_state_dict"],
    )


def test_finished_run_rewrites_nothing(full_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "cell-a"
    shutil.copytree(full_run, out)
    before = snapshot(out)

    proc = train_ok(out, "--steps", "200")
    assert "already finished" in proc.stdout
    assert snapshot(out) == before

    # A different model in the same directory is refused, not silently restarted.
    proc = train(out, "--steps", "300", "--hidden", "32")
    assert proc.returncode == 2, proc.stderr
    assert "hidden=64" in proc.stderr
    assert snapshot(out) == before


def test_truncated_newest_checkpoint_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "cell-a"
    train_ok(out, "--steps", "100", "--save-every", "50")
    newest = out / "ckpt-000100.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

    proc = train_ok(out, "--steps", "150", "--save-every", "50")
    assert "skipping unloadable checkpoint ckpt-000100.pt" in proc.stderr
    assert "resumed from ckpt-000050.pt at step 50" in proc.stdout
    m = metrics(out)
    assert (m["resumed_from"], m["step"]) == (50, 150)
    assert load(newest)["step"] == 100, "the broken checkpoint is rewritten by the resumed run"


class LineReader:
    """Reads a pipe on a thread so the test can wait for a line with a deadline instead of sleeping."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._stream:
            self._lines.put(line)
        self._lines.put(None)

    def wait_for(self, pattern: str, deadline_s: float) -> list[str]:
        """Lines up to and including the first one containing `pattern`."""
        seen: list[str] = []
        deadline = time.monotonic() + deadline_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                pytest.fail(f"stream ended before a line containing {pattern!r}; got {seen!r}")
            seen.append(line)
            if pattern in line:
                return seen
        pytest.fail(f"no line containing {pattern!r} within {deadline_s}s; got {seen!r}")

    def close(self, timeout_s: float = 30) -> None:
        """Call after the writer has exited: the pump sees EOF, then the pipe is closed."""
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "stdout pump did not reach EOF"
        self._stream.close()


def test_sigterm_saves_then_exits_143(tmp_path: Path) -> None:
    out = tmp_path / "cell-a"
    stderr_path = tmp_path / "stderr.txt"
    argv = [sys.executable, str(SCRIPT), "--out", str(out), "--steps", "400", "--save-every", "400"]
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [*argv, "--log-every", "1", "--step-delay-s", "0.05"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        reader = LineReader(proc.stdout)
        try:
            reader.wait_for("step 3/400", deadline_s=60)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader.close()
    err = stderr_path.read_text()
    assert rc == 128 + signal.SIGTERM, err

    steps = ckpt_steps(out)
    assert len(steps) == 1, steps
    (stopped_at,) = steps
    assert 3 <= stopped_at < 400
    assert f"terminated by signal {int(signal.SIGTERM)} at step {stopped_at}" in err
    assert load(out / f"ckpt-{stopped_at:06d}.pt")["step"] == stopped_at
    assert not list(out.glob("*.tmp"))
    assert not (out / "metrics.json").exists(), "only a finished run writes metrics"

    proc2 = train_ok(out, "--steps", "400", "--save-every", "400")
    assert f"resumed from ckpt-{stopped_at:06d}.pt at step {stopped_at}" in proc2.stdout
    m = metrics(out)
    assert (m["resumed_from"], m["step"]) == (stopped_at, 400)
