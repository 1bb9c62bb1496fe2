"""Training progress read from a job's log: the step, the loss, the step rate, the non-finite losses.

This module owns two things for the health sampler: `ProgressTracker`, which turns the raw bytes of
a job's log into those numbers (pure logic, fed chunks split anywhere), and `LogFollower`, which
hands over what was appended to the log file since the last look (blocking: call it from a worker
thread, never from the event loop). The step and the loss come from two regexes, one named group
each; the defaults read HF Trainer, PyTorch Lightning, tqdm bars and plain print loops, and take
the training loss only: `val_loss`, `eval_loss`, `test_loss` and `val loss` are not it.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from sidecar.compat import SLOTS
from sidecar.paths import open_regular

# A step: `step 100`, `step=100`, `Step: 100`, `[step 100]`, `Step [5/100]`, `iter 100 |`,
# `global_step=100`, `iteration 100/500`; or the N of a tqdm bar's `| N/M [` (HF Trainer,
# Lightning), except the bars Lightning draws while validating, testing or predicting, whose lines
# start with that word (HF's eval bar has no name to tell it by).
DEFAULT_STEP_RE = (
    r"(?i)(?:\b(?:global_step|step|iter(?:ation)?)\b[\s:=#\[(]*"
    r"|^(?!\s*(?:validat|sanity|test|predict)).*?\|\s*(?=\d+/\d+\s*\[))"
    r"(?P<step>\d+)"
)
# A training loss: `'loss': 0.43` (HF), `loss=0.1`, `train_loss=0.1`, `train_loss_step=0.1`
# (Lightning), `Loss: 1.2e-3`, `loss 2.3`, `loss: tensor(0.25...`, `lm loss: 2.3E+00`. The word
# `loss` must not be glued to another word (`val_loss`, `eval_loss`, `loss_scale`, `aux_loss`,
# `val/loss`) unless that word is `train`/`training`, nor follow `val `, `valid `, `validation `
# or `test `. The word comes first and the checks on what precedes it look behind, so that they
# run only where `loss` is (4x faster than checking ahead at every position).
DEFAULT_LOSS_RE = (
    r"(?i)loss(?:(?<![\w/.\-]loss)|(?<=train[_/ ]loss)|(?<=training[_/ ]loss))"
    r"(?<!val loss)(?<!valid loss)(?<!validation loss)(?<!test loss)"
    r"(?:_step)?['\"]?\s*[:=]?\s*(?:tensor\()?"
    r"(?P<loss>[-+]?(?:nan|inf(?:inity)?|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?))"
)
# Cheap substring tests (on the lowercased line) that every match of the default regexes passes:
# most lines of a log are skipped without running a regex.
_STEP_HINTS = ("step", "iter", "|")
_LOSS_HINTS = ("loss",)

MAX_PARTIAL = 64 * 1024  # bytes of an unfinished line kept; the rest of that line is dropped
RATE_WINDOW_S = 30.0  # steps_per_s is measured over the step points of this many seconds
LINE_KEPT = 200  # characters of a line with a non-finite loss kept in last_nonfinite

_LINE_END = re.compile(r"[\r\n]+")


def _compile(pattern: str, group: str, what: str) -> re.Pattern[str]:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{what} pattern {pattern!r} is not a valid regular expression: {e}") from None
    if group not in compiled.groupindex:
        raise ValueError(f"{what} pattern {pattern!r} has no named group (?P<{group}>...)")
    return compiled


def validate_patterns(step_re: str | None, loss_re: str | None) -> None:
    """Raise ValueError, naming the problem, unless each pattern given compiles and has its group.

    None stands for the default pattern."""
    if step_re is not None:
        _compile(step_re, "step", "step")
    if loss_re is not None:
        _compile(loss_re, "loss", "loss")


@dataclass(frozen=True, **SLOTS)
class Progress:
    """What a ProgressTracker knew at one moment (its attributes of the same names)."""

    step: int | None
    loss: float | None
    steps_per_s: float | None
    last_line_at: float | None
    lines: int
    nonfinite_count: int
    last_nonfinite: str
    dropped_bytes: int


class ProgressTracker:
    """Reads the step and the loss from a job's log, fed its bytes as they arrive.

    A line ends at \\n or \\r (progress bars redraw a line with \\r, so each drawing is a line,
    read when the next one starts); blank lines are not lines. Not thread-safe: feed and read in
    one thread, or hand `snapshot()` to another.

    Attributes, read after `feed`: `step` and `loss` (the latest read, NaN included);
    `steps_per_s` (over the step points of the last RATE_WINDOW_S seconds, as of the last feed
    that moved the step, so a stalled job keeps its last rate: see `last_line_at` and `step`;
    None until two points with increasing step; a step going backwards, a new epoch's bar or a
    restart, starts the window afresh); `last_line_at` (the clock's time of the last complete
    line); `lines`; `nonfinite_count` (non-finite losses ever seen: a sampler that looks once a
    second misses none, even if a finite loss came after); `last_nonfinite` (that line, cut to
    LINE_KEPT characters); `dropped_bytes` (of a line held unfinished between feeds beyond
    MAX_PARTIAL: its head is read when its end comes, the rest is not; a long line that arrives
    whole in one feed is read whole).
    """

    def __init__(
        self,
        step_re: str | None = None,
        loss_re: str | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._step_re = _compile(DEFAULT_STEP_RE if step_re is None else step_re, "step", "step")
        self._loss_re = _compile(DEFAULT_LOSS_RE if loss_re is None else loss_re, "loss", "loss")
        # A user's regex may match anything: the prefilter only guards the defaults.
        self._step_hints = _STEP_HINTS if step_re is None else None
        self._loss_hints = _LOSS_HINTS if loss_re is None else None
        self._lower = step_re is None or loss_re is None
        self._clock = clock
        self._pending = b""
        # (time, step) points, one per feed that moved the step; bounded whatever the feed rate.
        self._points: deque[tuple[float, int]] = deque(maxlen=256)
        self.step: int | None = None
        self.loss: float | None = None
        self.steps_per_s: float | None = None
        self.last_line_at: float | None = None
        self.lines = 0
        self.nonfinite_count = 0
        self.last_nonfinite = ""
        self.dropped_bytes = 0

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the log; any split (mid-line, mid-UTF-8 character) is fine."""
        end = max(data.rfind(b"\n"), data.rfind(b"\r"))
        if end < 0:
            self._keep(data)
            return
        if self._pending:
            nl, cr = data.find(b"\n"), data.find(b"\r")
            first = min(nl, cr) if nl >= 0 and cr >= 0 else max(nl, cr)
            over = len(self._pending) + first - MAX_PARTIAL
            if over > 0:  # the held line is full: the rest of it, up to its end, is dropped
                self.dropped_bytes += over
                data = data[: first - over] + data[first:]
                end -= over
        # Lines end at ASCII bytes, which are never inside a UTF-8 sequence: decoding whole lines
        # needs no incremental decoder. Undecodable bytes become U+FFFD.
        text = (self._pending + data[:end]).decode("utf-8", "replace")
        self._pending = b""
        self._keep(data[end + 1 :])
        step, lines = self.step, self.lines
        for line in _LINE_END.split(text):
            if line:
                self._line(line)
        if self.lines == lines:
            return
        now = self._clock()  # once a feed: the lines of one chunk arrived together
        self.last_line_at = now
        if self.step is not None and self.step != step:
            self._rate(now, self.step)

    def snapshot(self) -> Progress:
        return Progress(
            step=self.step,
            loss=self.loss,
            steps_per_s=self.steps_per_s,
            last_line_at=self.last_line_at,
            lines=self.lines,
            nonfinite_count=self.nonfinite_count,
            last_nonfinite=self.last_nonfinite,
            dropped_bytes=self.dropped_bytes,
        )

    def _keep(self, partial: bytes) -> None:
        room = MAX_PARTIAL - len(self._pending)
        if len(partial) > room:
            self.dropped_bytes += len(partial) - room
            partial = partial[:room]
        if partial:
            self._pending += partial

    def _line(self, line: str) -> None:
        self.lines += 1
        low = line.lower() if self._lower else line
        if self._step_hints is None or any(h in low for h in self._step_hints):
            m = self._step_re.search(line)
            if m is not None:
                text = m.group("step")
                if text is not None and text.isdecimal():  # a user's group may match otherwise
                    self.step = int(text)
        if self._loss_hints is None or any(h in low for h in self._loss_hints):
            m = self._loss_re.search(line)
            if m is not None:
                try:
                    loss = float(m.group("loss"))
                except (TypeError, ValueError):
                    return
                self.loss = loss
                if not math.isfinite(loss):
                    self.nonfinite_count += 1
                    self.last_nonfinite = line[:LINE_KEPT]

    def _rate(self, now: float, step: int) -> None:
        points = self._points
        if points and step < points[-1][1]:
            points.clear()
        if points and points[-1][0] == now:
            points[-1] = (now, step)  # several steps in one feed: one point, the latest step
        else:
            points.append((now, step))
        while points and points[0][0] < now - RATE_WINDOW_S:
            points.popleft()
        (t0, s0), (t1, s1) = points[0], points[-1]
        self.steps_per_s = (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None


class LogFollower:
    """Hands over the bytes appended to one file since the previous call. Blocking.

    The file is opened at the first call that finds it. If it shrank (truncated in place), reading
    starts over at its beginning; if another file took its name (renamed over it, or deleted and
    made anew), the old one's unread bytes (up to max_read of them) come first, then the new one
    from its beginning. While the name is missing, the open file is still read: a job may write
    on. A truncation followed by more writes than were read before looks like growth:
    `copytruncate` rotation can lose or repeat a stretch, as with `tail -F`.
    """

    def __init__(self, path: Path, *, max_read: int = 1 << 20, start_tail: int | None = None) -> None:
        """`start_tail`: the file found at the first open is read from at most this many bytes
        before its end, from the first whole line there (a sidecar that starts again follows a
        long-running job's log from about now, not from its first line)."""
        if max_read < 1:
            raise ValueError(f"max_read must be at least 1, not {max_read}")
        self.path = path
        self._max_read = max_read
        self._fd: int | None = None
        self._ident = (0, 0)  # (st_dev, st_ino) of the open file
        self._pos = 0
        self._tail = start_tail
        self._partial = False  # the bytes up to the next newline are the rest of a line cut by the tail

    def read_new(self) -> bytes:
        """At most max_read bytes appended since the last call (the rest next time); b"" while the
        file does not exist. Never raises for a missing file and never blocks on what took its
        name: a FIFO, a device or a symlink is an OSError (EINVAL, ELOOP), as are EACCES and the
        like; the file read so far is let go, and a later call tries the name again."""
        fd = self._fd
        if fd is not None:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                st = None  # deleted: what was written before stays readable through our fd
            if st is not None and (st.st_dev, st.st_ino) != self._ident:
                tail = self._read(fd)
                self.close()
                if tail:
                    return tail
                fd = None
        if fd is None:
            fd = self._open()
            if fd is None:
                return b""
        return self._read(fd)

    def close(self) -> None:
        """Close the file; a later read_new opens it anew and reads from its beginning."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> LogFollower:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _open(self) -> int | None:
        try:  # a plain open() of a FIFO put there waits for a writer forever
            fd = open_regular(self.path, follow=False)
        except FileNotFoundError:
            return None
        st = os.fstat(fd)
        self._fd, self._ident, self._pos = fd, (st.st_dev, st.st_ino), 0
        if self._tail is not None and st.st_size > self._tail:
            self._pos, self._partial = st.st_size - self._tail, True
        self._tail = None  # only the file found first: a later one is new, read whole
        return fd

    def _read(self, fd: int) -> bytes:
        if os.fstat(fd).st_size < self._pos:
            self._pos, self._partial = 0, False
        data = os.pread(fd, self._max_read, self._pos)
        self._pos += len(data)
        if self._partial and data:
            cut = data.find(b"\n")
            if cut < 0:
                return b""  # still inside the cut line (more is read at the next call)
            self._partial = False
            data = data[cut + 1 :]
        return data
