"""Training progress from a job's log: the parsing of each common format, the byte-level framing
(splits anywhere, \\r redraws, the partial-line cap), the rate on an injected clock, and the file
follower on real files in tmp_path."""

from __future__ import annotations

import errno
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.progress import (
    LINE_KEPT,
    MAX_PARTIAL,
    LogFollower,
    ProgressTracker,
    validate_patterns,
)


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fed(*lines: str, step_re: str | None = None, loss_re: str | None = None) -> ProgressTracker:
    tracker = ProgressTracker(step_re, loss_re)
    tracker.feed("".join(lines).encode())
    return tracker


HF_BAR = "  5%|▌         | 50/1000 [00:10<03:10,  5.00it/s]"
HF_LOG = "{'loss': 0.4321, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.5}"
PL_BAR = "Epoch 0:  45%|████▌     | 450/1000 [00:30<00:36, 15.00it/s, v_num=0, train_loss=0.123]"


@pytest.mark.parametrize(
    ("line", "step", "loss"),
    [
        (HF_BAR, 50, None),
        (HF_LOG, None, 0.4321),
        (PL_BAR, 450, 0.123),
        ("Epoch 2:  10%|█         | 100/1000 [00:05<00:45, 20.00it/s, loss=0.123, v_num=1]", 100, 0.123),
        ("Epoch 0: 100%|█████| 9/9 [00:01<00:00, train_loss_step=0.25, train_loss_epoch=0.5]", 9, 0.25),
        ("step 100 loss 0.5", 100, 0.5),
        ("Step: 100, Loss: 1.2e-3", 100, 1.2e-3),
        ("[step 100] loss: 0.25", 100, 0.25),
        ("iter 100 | loss 2.3", 100, 2.3),
        ("Epoch [1/10], Step [200/600], Loss: 0.0421", 200, 0.0421),
        ("global_step=7 train/loss=3.5", 7, 3.5),
        (" iteration      300/  500000 | lm loss: 2.345678E+00 |", 300, 2.345678),
        ("step 12: loss tensor(0.6931, device='cuda:0', grad_fn=<NllLossBackward0>)", 12, 0.6931),
        ("train loss .5 at ITER 9", 9, 0.5),
    ],
)
def test_default_formats(line: str, step: int | None, loss: float | None) -> None:
    tracker = fed(line, "\n")
    assert (tracker.step, tracker.loss, tracker.lines) == (step, loss, 1)
    assert tracker.nonfinite_count == 0


def test_hf_trainer_takes_the_step_from_the_bar_and_the_loss_from_the_dict() -> None:
    tracker = fed("\r", HF_BAR, "\r", "  5%|▌         | 51/1000 [00:10<03:10,  5.00it/s]\n", HF_LOG, "\n")
    assert (tracker.step, tracker.loss, tracker.lines) == (51, 0.4321, 3)


@pytest.mark.parametrize(
    ("line", "loss"),
    [
        ("{'loss': nan, 'grad_norm': nan, 'learning_rate': 5e-05, 'epoch': 0.5}", math.nan),
        ("{'loss': inf, 'grad_norm': 1.0}", math.inf),
        ("step=100 loss=nan", math.nan),
        ("step 100 loss NaN", math.nan),
        ("loss: -inf", -math.inf),
        ("Loss: Infinity", math.inf),
        ("loss=-Infinity", -math.inf),
    ],
)
def test_nonfinite_losses(line: str, loss: float) -> None:
    tracker = fed(line, "\n")
    assert tracker.loss is not None
    assert math.isnan(tracker.loss) if math.isnan(loss) else tracker.loss == loss
    assert (tracker.nonfinite_count, tracker.last_nonfinite) == (1, line)


def test_a_nan_followed_by_a_finite_loss_is_still_counted() -> None:
    tracker = fed("step 1 loss nan\n", "step 2 loss 0.5\n")
    assert (tracker.loss, tracker.step) == (0.5, 2)
    assert (tracker.nonfinite_count, tracker.last_nonfinite) == (1, "step 1 loss nan")
    tracker.feed(b"step 3 loss inf\nstep 4 loss 0.4\nstep 5 loss 0.3\n")
    assert (tracker.loss, tracker.nonfinite_count, tracker.last_nonfinite) == (0.3, 2, "step 3 loss inf")


def test_last_nonfinite_is_cut() -> None:
    line = "loss nan " + "x" * 1000
    tracker = fed(line, "\n")
    assert tracker.last_nonfinite == line[:LINE_KEPT]
    assert len(tracker.last_nonfinite) == LINE_KEPT


@pytest.mark.parametrize(
    "line",
    [
        "{'eval_loss': 0.9, 'eval_runtime': 1.2, 'epoch': 1.0}",
        "Epoch 3: val_loss=0.7",
        "val loss 0.7",
        "validation loss: 0.7",
        "test loss 0.7",
        "val/loss=0.7",
        "test_loss=nan",
        "loss_scale: 65536.0",
        "aux_loss=0.2 kl_loss=nan",
    ],
)
def test_eval_and_other_losses_are_not_the_training_loss(line: str) -> None:
    tracker = fed(line, "\n")
    assert (tracker.loss, tracker.nonfinite_count, tracker.lines) == (None, 0, 1)


def test_training_loss_is_found_beside_a_validation_loss() -> None:
    tracker = fed("Epoch 1: 100%|██| 10/10 [00:01<00:00, v_num=0, val_loss=0.9, train_loss=0.2]\n")
    assert (tracker.step, tracker.loss) == (10, 0.2)
    assert fed("val_loss=nan loss=0.3\n").loss == 0.3


def test_lightning_validation_bars_do_not_move_the_step() -> None:
    tracker = fed(
        PL_BAR,
        "\rValidation DataLoader 0:  50%|█████     | 5/10 [00:00<00:00, 50.00it/s]",
        "\rSanity Checking DataLoader 0: 100%|██████████| 2/2 [00:00<00:00, 9.0it/s]",
        "\rTesting DataLoader 0: 100%|██████████| 3/3 [00:00<00:00, 9.0it/s]\n",
    )
    assert (tracker.step, tracker.lines) == (450, 4)


def test_carriage_returns_end_lines_and_the_bar_being_drawn_waits_for_its_end() -> None:
    tracker = ProgressTracker()
    tracker.feed(b"\r  1%|          | 10/1000 [00:01<01:39, 10.0it/s]\r  2%|          | 20/1000 [00:02<01:38")
    assert (tracker.step, tracker.lines) == (10, 1)
    tracker.feed(b", 10.0it/s]\r")
    assert (tracker.step, tracker.lines) == (20, 2)
    tracker.feed(b"step 21 loss 0.1\r\n\n\nstep 22 loss 0.2\r\n")  # blank lines are not lines
    assert (tracker.step, tracker.loss, tracker.lines) == (22, 0.2, 4)


LOG = (
    "Époque 1 — démarrage ✓\n"
    + PL_BAR
    + "\r"
    + "step 451 loss nan ✗ ünïcode\n"
    + "\rEpoch 0:  46%|████▋     | 460/1000 [00:31<00:35, 15.00it/s, v_num=0, train_loss=0.125]\r"
).encode()


def test_splits_anywhere_give_the_same_result_as_one_feed() -> None:
    clock = Clock()
    whole = ProgressTracker(clock=clock)
    whole.feed(LOG)
    assert (whole.step, whole.loss, whole.lines, whole.nonfinite_count) == (460, 0.125, 4, 1)
    assert whole.last_nonfinite == "step 451 loss nan ✗ ünïcode"
    for cut in range(len(LOG) + 1):
        split = ProgressTracker(clock=clock)
        split.feed(LOG[:cut])
        split.feed(LOG[cut:])
        assert split.snapshot() == whole.snapshot(), cut
    bytewise = ProgressTracker(clock=clock)
    for i in range(len(LOG)):
        bytewise.feed(LOG[i : i + 1])
    assert bytewise.snapshot() == whole.snapshot()
    assert "\ufffd" not in bytewise.last_nonfinite


def test_an_unfinished_line_is_capped_and_the_excess_counted() -> None:
    tracker = ProgressTracker()
    for _ in range(25):
        tracker.feed(b"x" * 4096)  # 100 KiB, no line end
    assert (tracker.lines, tracker.dropped_bytes) == (0, 25 * 4096 - MAX_PARTIAL)
    assert tracker.last_line_at is None
    tracker.feed(b" step 5 loss nan\nstep 6 loss 0.5\n")  # the dropped tail of a line is not read
    assert (tracker.lines, tracker.step, tracker.loss, tracker.nonfinite_count) == (2, 6, 0.5, 0)
    assert tracker.dropped_bytes == 25 * 4096 - MAX_PARTIAL + len(b" step 5 loss nan")
    tracker.feed(b"step 7 loss nan " + b"y" * (MAX_PARTIAL + 10) + b"\n")  # the head is kept
    assert (tracker.step, tracker.nonfinite_count) == (7, 1)


def test_custom_patterns_replace_the_defaults() -> None:
    tracker = fed(
        "it=4 L=0.75\n", "step 100 loss 0.5\n", "it=x L=soon\n", "val_loss=nan\n",
        step_re=r"it=(?P<step>\S+)", loss_re=r"(?:L|val_loss)=(?P<loss>\S+)",
    )  # fmt: skip
    assert (tracker.step, tracker.nonfinite_count, tracker.lines) == (4, 1, 4)
    assert tracker.loss is not None and math.isnan(tracker.loss)
    only_step = fed("step=3 LOSS=0.5\n", step_re=r"step=(?P<step>\d+)")
    assert (only_step.step, only_step.loss) == (3, 0.5)  # the default loss pattern still applies


@pytest.mark.parametrize(
    ("step_re", "loss_re", "message"),
    [
        ("step (?P<step>\\d+", None, "step pattern 'step (?P<step>\\\\d+' is not a valid regular expression"),
        (None, "loss[", "loss pattern 'loss[' is not a valid regular expression"),
        (r"step (\d+)", None, "has no named group (?P<step>...)"),
        (None, r"(?P<step>\d+)", "loss pattern '(?P<step>\\\\d+)' has no named group (?P<loss>...)"),
        ("", None, "has no named group (?P<step>...)"),
    ],
)
def test_bad_patterns_are_value_errors(step_re: str | None, loss_re: str | None, message: str) -> None:
    with pytest.raises(ValueError, match="pattern") as raised:
        validate_patterns(step_re, loss_re)
    assert message in str(raised.value)
    with pytest.raises(ValueError) as raised:
        ProgressTracker(step_re, loss_re)
    assert message in str(raised.value)


def test_good_patterns_validate() -> None:
    validate_patterns(None, None)
    validate_patterns(r"(?P<step>\d+)", r"(?P<loss>\S+)")


def test_rate_and_last_line_time_follow_the_injected_clock() -> None:
    clock = Clock(100.0)
    tracker = ProgressTracker(clock=clock)
    assert (tracker.steps_per_s, tracker.last_line_at) == (None, None)
    tracker.feed(b"step 0 loss 1.0\n")
    assert (tracker.steps_per_s, tracker.last_line_at) == (None, 100.0)
    clock.now = 110.0
    tracker.feed(b"step 50 loss 0.9\nstep 100 loss 0.8\n")
    assert (tracker.steps_per_s, tracker.last_line_at) == (10.0, 110.0)
    clock.now = 112.0
    tracker.feed(b"loss 0.8 with no step\n")  # the step did not move: the rate stands
    assert (tracker.steps_per_s, tracker.last_line_at) == (10.0, 112.0)
    clock.now = 120.0
    tracker.feed(b"step 300\n")
    assert tracker.steps_per_s == 15.0  # (300 - 0) / (120 - 100)
    clock.now = 145.0
    tracker.feed(b"step 400\n")
    assert tracker.steps_per_s == 4.0  # points older than 30 s gone: (400 - 300) / (145 - 120)
    clock.now = 146.0
    tracker.feed(b"step")  # no complete line: nothing moves
    assert (tracker.last_line_at, tracker.steps_per_s) == (145.0, 4.0)
    tracker.feed(b" 5\n")  # backwards (a new epoch's bar, a restart): the window starts afresh
    snap = tracker.snapshot()  # read afresh: mypy keeps the narrowing of the attributes above
    assert (snap.step, snap.steps_per_s, snap.last_line_at) == (5, None, 146.0)
    clock.now = 148.0
    tracker.feed(b"step 25\n")
    assert tracker.steps_per_s == 10.0


def test_snapshot_holds_the_attributes() -> None:
    tracker = fed("step 3 loss nan\n", "xy")
    snap = tracker.snapshot()
    assert (snap.step, snap.lines, snap.nonfinite_count, snap.dropped_bytes) == (3, 1, 1, 0)
    assert snap.loss is not None and math.isnan(snap.loss)
    assert snap.last_nonfinite == "step 3 loss nan"
    assert snap.last_line_at == tracker.last_line_at is not None
    tracker.feed(b"\n")
    assert (snap.lines, tracker.lines) == (1, 2)


def test_follower_reads_appends_and_waits_for_a_missing_file(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    with LogFollower(log) as follower:
        assert follower.read_new() == b""
        log.write_bytes(b"step 1\n")
        assert follower.read_new() == b"step 1\n"
        assert follower.read_new() == b""
        with log.open("ab", buffering=0) as job:
            job.write(b"step 2\nstep")
            assert follower.read_new() == b"step 2\nstep"
            log.unlink()
            assert follower.read_new() == b""  # deleted: nothing new, no error
            job.write(b" 3\n")  # the job writes on to its open file: still read
            assert follower.read_new() == b" 3\n"
        log.write_bytes(b"fresh\n")
        assert follower.read_new() == b"fresh\n"


def test_follower_starts_over_after_truncation(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_bytes(b"a" * 100)
    follower = LogFollower(log)
    assert follower.read_new() == b"a" * 100
    log.write_bytes(b"short\n")  # truncated in place: same inode
    assert follower.read_new() == b"short\n"
    assert follower.read_new() == b""
    follower.close()


def test_follower_moves_to_a_file_renamed_over_the_old_one(tmp_path: Path) -> None:
    log, new = tmp_path / "job.log", tmp_path / "job.log.new"
    log.write_bytes(b"old 1\n")
    follower = LogFollower(log)
    assert follower.read_new() == b"old 1\n"
    with log.open("ab") as f:
        f.write(b"old 2\n")
    new.write_bytes(b"new 1\nnew 2\n" + b"n" * 200)  # longer than the old: not a truncation
    os.replace(new, log)
    assert follower.read_new() == b"old 2\n"  # the old file's unread tail first
    assert follower.read_new() == b"new 1\nnew 2\n" + b"n" * 200
    new.write_bytes(b"newer\n")
    os.replace(new, log)  # nothing unread in the old one: the new one at once
    assert follower.read_new() == b"newer\n"
    assert follower.read_new() == b""
    follower.close()


def test_follower_reads_at_most_max_read(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_bytes(b"0123456789")
    follower = LogFollower(log, max_read=4)
    assert [follower.read_new() for _ in range(4)] == [b"0123", b"4567", b"89", b""]
    follower.close()
    follower.close()  # twice is fine
    assert follower.read_new() == b"0123"  # after close: opened anew, from the beginning
    follower.close()
    with pytest.raises(ValueError, match="max_read"):
        LogFollower(log, max_read=0)


def test_follower_feeds_a_tracker(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    tracker = ProgressTracker(clock=Clock(7.0))
    with LogFollower(log, max_read=5) as follower, log.open("wb", buffering=0) as writer:
        writer.write(LOG)
        while chunk := follower.read_new():
            tracker.feed(chunk)
    assert (tracker.step, tracker.loss, tracker.lines, tracker.nonfinite_count) == (460, 0.125, 4, 1)
    assert tracker.last_nonfinite == "step 451 loss nan ✗ ünïcode"


def test_a_follower_that_starts_late_reads_from_a_whole_line_near_the_end(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    old = b"step 1 loss=nan\n" + b"".join(b"step %d loss=0.5\n" % i for i in range(2, 200_000))
    log.write_bytes(old)
    f = LogFollower(log, start_tail=64 << 10)
    data = b""
    while chunk := f.read_new():
        data += chunk
    assert 0 < len(data) <= 64 << 10
    assert data.startswith(b"step ") and data.endswith(b"\n")  # the cut line is left out whole
    assert b"nan" not in data and data.splitlines()[-1] == b"step 199999 loss=0.5"
    with open(log, "ab") as out:
        out.write(b"step 200000 loss=0.25\n")
    assert f.read_new() == b"step 200000 loss=0.25\n"  # then every new byte, as before
    f.close()
    # A file found later (the first was replaced) is new: read from its beginning.
    log.unlink()
    log.write_bytes(b"step 1 loss=1.0\n")
    assert f.read_new() == b"step 1 loss=1.0\n"
    f.close()


def test_job_logs_seen_for_the_first_time_do_not_report_an_old_nonfinite_loss(tmp_path: Path) -> None:
    from sidecar.health import LOG_TAIL, JobLogs

    log = tmp_path / "j1.log"
    lines = [b"step 1 loss=nan\n"] + [b"step %d loss=0.5\n" % i for i in range(2, 2 * LOG_TAIL // 16)]
    log.write_bytes(b"".join(lines))
    logs = JobLogs(None, None)
    logs.follow((("j1", str(log)),))
    got = logs.poll()["j1"]
    assert got.nonfinite_count == 0 and got.loss == 0.5 and got.step == len(lines)
    with open(log, "ab") as out:
        out.write(b"step %d loss=nan\n" % (len(lines) + 1))
    assert logs.poll()["j1"].nonfinite_count == 1  # a new one is news


def _within(fn: Callable[[], object], seconds: float = 10.0) -> object:
    """fn() run on a daemon thread; fails (rather than hanging the suite) if it blocks."""
    box: list[object] = []
    t = threading.Thread(target=lambda: box.append(_outcome(fn)), daemon=True)
    t.start()
    t.join(seconds)
    assert box, f"blocked for {seconds} s"
    return box[0]


def _outcome(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except OSError as e:
        return e


def test_a_fifo_or_symlink_in_the_logs_place_is_refused_without_blocking(tmp_path: Path) -> None:
    """A job can put a FIFO where its log was (`rm L; mkfifo L`): the follower's plain open() of it
    waited for a writer forever, and with it the sidecar's progress probe (stale from then on)."""
    log = tmp_path / "job.log"
    log.write_bytes(b"step 1 loss=1.0\n")
    f = LogFollower(log)
    assert f.read_new() == b"step 1 loss=1.0\n"
    log.unlink()
    os.mkfifo(log)
    err = _within(f.read_new)
    assert isinstance(err, OSError) and err.errno == errno.EINVAL and "fifo" in str(err)
    log.unlink()
    (tmp_path / "other.txt").write_bytes(b"step 9 loss=9.0\n")
    log.symlink_to(tmp_path / "other.txt")
    err = _within(f.read_new)
    assert isinstance(err, OSError) and err.errno == errno.ELOOP  # a symlink is never followed
    log.unlink()
    log.write_bytes(b"step 2 loss=0.5\n")
    assert f.read_new() == b"step 2 loss=0.5\n"  # a regular file again: followed from its start
    f.close()


def test_job_logs_go_on_for_the_other_jobs_when_one_log_is_a_fifo(tmp_path: Path) -> None:
    from sidecar.health import JobLogs

    good, bad = tmp_path / "j1.log", tmp_path / "j2.log"
    good.write_bytes(b"step 1 loss=1.0\n")
    os.mkfifo(bad)
    logs = JobLogs(None, None)
    logs.follow((("j2", str(bad)), ("j1", str(good))))
    got = _within(logs.poll)
    assert isinstance(got, dict) and got["j1"].step == 1 and got["j2"].step is None
    with open(good, "ab") as out:
        out.write(b"step 2 loss=0.5\n")
    got = _within(logs.poll)
    assert isinstance(got, dict) and got["j1"].step == 2
