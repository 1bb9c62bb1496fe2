"""Render: the only module that prints. Human text, tables and progress go to stderr; `--json`
output is one JSON document on stdout."""

from __future__ import annotations

import codecs
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.proofs import proof_kind

# rich is imported where it is used (about 0.1 s): a `--json` command never loads it, and a command
# that prints no table or progress bar loads only its console.
if TYPE_CHECKING:  # annotations only: `artifacts --json` must not pay for importing all of these
    from rich.console import Console
    from rich.progress import Progress, TaskID
    from rich.table import Table

    from controller.bootstrap import UpResult
    from controller.checks import Finding
    from controller.drain import DrainReport
    from controller.errors import Reason
    from controller.gate import Verdict
    from controller.profiles import Profile
    from controller.pull import PullReport
    from controller.state import Box
    from controller.teardown import TeardownResult
    from controller.verify import VerifyReport

# What a terminal would act on instead of showing: C0 controls (ESC starts a sequence; CR and BS
# overwrite what was shown), DEL, C1 controls (U+009B is a CSI on many terminals) and the bidi
# embeddings, overrides and isolates that reorder the text around them (Trojan Source).
_UNSAFE = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), 0x061C, 0x200E, 0x200F]
_UNSAFE += [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPES = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE}
_ESCAPES_MULTILINE = {c: e for c, e in _ESCAPES.items() if chr(c) not in "\n\t"}


def safe(text: str, *, multiline: bool = False) -> str:
    """`text` with everything a terminal would act on shown as an escape (`\\x9b`, `\\u202e`), so that
    a name, path or detail from the box or a file is seen as it is. `multiline` keeps newlines and
    tabs (messages, console steps); never for one name or path."""
    return text.translate(_ESCAPES_MULTILINE if multiline else _ESCAPES)


def esc(text: str, *, multiline: bool = False) -> str:
    """Untrusted text made safe to print with markup: terminal controls escaped, markup escaped."""
    from rich.markup import escape

    return escape(safe(text, multiline=multiline))


def esc_block(text: str, indent: str = "    ") -> str:
    """`esc` of a message of several lines (its lines after the first indented): a line of box text
    in it (a log's tail, a command line) never starts a line of its own that reads as this output's."""
    return esc(text, multiline=True).replace("\n", "\n" + indent)


def _console() -> Console:
    # Built per call so that a redirected sys.stderr (tests, pipes) is honoured.
    from rich.console import Console

    return Console(file=sys.stderr, highlight=False, soft_wrap=True)


def _table(title: str) -> Table:
    from rich.table import Table

    return Table(title=title)


def info(msg: str) -> None:
    _console().print(msg)


def table_out(t: Table) -> None:
    """A rich table, where every message goes (stderr)."""
    _console().print(t)


def error(msg: str) -> None:
    _console().print(f"[bold red]error:[/] {esc_block(msg)}")


def warn(msg: str) -> None:
    _console().print(f"[bold yellow]warning:[/] {esc_block(msg)}")


def json_out(doc: object, *, compact: bool = False) -> None:
    """`compact`: one line, for documents that can be huge (100,000 claims): only the C encoder,
    which indent turns off, writes those in well under a second."""
    text = json.dumps(doc, sort_keys=True) if compact else json.dumps(doc, indent=2, sort_keys=True)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def text_out(text: str) -> None:
    """A document already rendered (as json_out would write it), and a newline."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def raw_out(data: bytes) -> None:
    sys.stdout.buffer.write(data)
    sys.stdout.flush()


def log_writer() -> Callable[[bytes], None]:
    """Where a job's log goes: into a file or a pipe, its bytes as they are; on a terminal, as
    `log_text` shows them."""
    if not sys.stdout.isatty():
        return raw_out
    text = log_text()

    def write(data: bytes) -> None:
        sys.stdout.write(text(data))
        sys.stdout.flush()

    return write


def log_text() -> Callable[[bytes], str]:
    """A log's bytes, fed in chunks split anywhere, as text to show: every control escaped (`safe`),
    and a line ending at a CR too, so that a progress bar's redraws are lines of their own and no
    line overwrites one shown before it."""
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
    held = ""  # a CR at a chunk's end: the LF of its CRLF may begin the next chunk

    def text(data: bytes) -> str:
        nonlocal held
        got = held + decode(data)
        held = "\r" if got.endswith("\r") else ""
        got = got[: len(got) - len(held)].replace("\r\n", "\n").replace("\r", "\n")
        return safe(got, multiline=True)

    return text


def event_line(rec: dict[str, object]) -> str:
    """One event of the journal (`controller.events.record`) as `boxwarden events` shows it."""
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_number(rec.get("at_unix_ns")) / 1e9))
    what = " ".join(str(rec.get(k) or "") for k in ("path", "job_id", "detail") if rec.get(k))
    return safe(f"{_number(rec.get('seq')):>7}  {at}  {rec.get('kind', '')!s:<20} {what}")


def _number(v: object) -> int:
    return v if isinstance(v, int) else 0


class SafeFormatter(logging.Formatter):
    """Log records as `safe` text: a message may quote what the box said (a path, an error)."""

    def format(self, record: logging.LogRecord) -> str:
        return safe(super().format(record), multiline=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def reasons(rs: Sequence[Reason]) -> None:
    c = _console()
    for r in rs:
        where = f" {r.path}" if r.path else ""
        c.print(f"  [red]{esc(r.code)}[/]{esc(where)}: {esc(r.detail)}")  # one line: box text in it too


def up_result(box: Box, res: UpResult) -> None:
    verb = "started" if res.started else "already running, left alone"
    if res.restarted_for:
        verb = "restarted to take " + "; ".join(res.restarted_for)
    info(
        f"[green]{esc(box.name)}[/]: sidecar {esc(res.hello.version)} {esc(verb)} (pid {res.hello.pid}); "
        f"run {esc(box.run_id)}, watching {esc(', '.join(box.watch))} → {esc(box.durable)}"
    )


def job_started(job: pb.Job) -> None:
    info(
        f"job [bold]{esc(job.id)}[/] started (pid {job.pid}, cell {esc(job.cell or '-')}); "
        f"log: {esc(job.log_path)}"
        + (
            f"; started again on failure, up to {job.max_restarts} times"
            if job.restart == "on-failure"
            else ""
        )
    )


def job_state(job: pb.Job) -> str:
    """ "running", "exited", "stopped", "lost"."""
    return pb.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()


def job_stopped(job: pb.Job) -> None:
    code = f", exit code {job.exit_code}" if job.state in (pb.JOB_STATE_EXITED, pb.JOB_STATE_STOPPED) else ""
    info(f"job [bold]{esc(job.id)}[/] {job_state(job)}{code}")


def human_duration(s: float) -> str:
    """Seconds as a person reads them: "0.4s", "42s", "3m04s", "2h05m"."""
    if s < 10:
        return f"{s:.1f}s"
    n = round(s)
    if n < 60:
        return f"{n}s"
    if n < 3600:
        return f"{n // 60}m{n % 60:02d}s"
    return f"{n // 3600}h{n // 60 % 60:02d}m"


def human_rate(bytes_per_s: float) -> str:
    """A measured bandwidth to three figures ("45.2 MiB/s", "118 MiB/s"); "-" before anything was
    measured (0)."""
    if bytes_per_s <= 0:
        return "-"
    n, units = bytes_per_s, ("B/s", "KiB/s", "MiB/s", "GiB/s", "TiB/s")
    for unit in units:
        if n < 1024 or unit == units[-1]:
            return f"{n:.0f} {unit}" if n >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def proof_kinds(proofs: dict[str, int]) -> str:
    """ "3 reread, 1 server-checksum": the kinds with a count, in that order; "" for none."""
    return ", ".join(f"{n} {kind}" for kind, n in proofs.items() if n)


STATUS_COLUMNS = ("box", "sidecar", "jobs", "durable", "not durable", "push rate", "disk free")


def status_cells(r: dict[str, object]) -> tuple[list[list[str]], str]:
    """One `status` row as the table's cells, each a few short lines (so that seven columns fit in
    80), and the sidecar's long story (unreachable since when and why, a teardown left unfinished)
    for a note under the table ("" when there is none)."""
    sidecar = r.get("sidecar")
    note = ""
    if r.get("unreachable"):
        short = "UNREACHABLE"
        seen = r.get("last_seen_s")
        ago = "never answered" if not isinstance(seen, (int, float)) else f"last seen {_ago(seen)} ago"
        note = f"UNREACHABLE ({ago}): {r.get('error', '')}"
    elif isinstance(sidecar, dict):
        short = str(sidecar.get("version", ""))
    else:
        short = str(r.get("status", ""))
    teardown = r.get("teardown")
    if isinstance(teardown, dict):
        unfinished = "teardown unfinished: " if r.get("status") == "up" else ""
        note = f"{note or short} ({unfinished}{teardown.get('summary', '')})"
    box = [str(r["box"]), str(r.get("profile", ""))]
    if "claims" not in r:  # not asked (not up) or no answer: only what the controller knows
        return [box, [short], [], [], [], [], []], note
    running, total = _count(r, "jobs_running"), _count(r, "jobs_total")
    jobs = [f"{running} running", f"of {total}"] if total != running else [f"{running} running"]
    proofs = r.get("proofs")
    kinds = proof_kinds(proofs).split(", ") if isinstance(proofs, dict) and any(proofs.values()) else []
    durable = [f"{_count(r, 'durable')} of {_count(r, 'claims')}", *kinds]
    if _count(r, "durable_only"):
        durable.append(f"{_count(r, 'durable_only')} durable-only")
    risk = [human_bytes(_count(r, "not_durable"))]
    lag = r.get("push_lag_s")
    if isinstance(lag, (int, float)) and lag > 0:
        risk.append(f"lag {human_duration(lag)}")
    rate = r.get("push_bytes_per_s")
    free = r.get("disk_free")
    return [
        box,
        [short],  # its pid is in `status --json`
        jobs if total else ["none"],
        durable,
        risk,
        [human_rate(rate) if isinstance(rate, (int, float)) else ""],
        [human_bytes(free) if isinstance(free, int) else ""],
    ], note


def _ago(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s"


def _count(r: dict[str, object], key: str) -> int:
    v = r.get(key)
    return v if isinstance(v, int) else 0


STATUS_FIGURES = frozenset({"jobs", "not durable", "push rate", "disk free"})
"""Columns whose lines are a figure and its unit ("117.7 MiB"): split only when nothing else helps."""


def status(rows: Sequence[dict[str, object]]) -> None:
    from rich.markup import escape

    cells, notes = [], []
    for r in rows:
        row, note = status_cells(r)
        cells.append([[safe(line) for line in cell] for cell in row])
        if note:
            notes.append(f"{esc(str(r['box']))}: {esc(note)}")
    c = _console()
    t = _table("boxes")
    t.box, t.show_edge, t.pad_edge = None, False, False  # two spaces between columns
    widths = []
    for i, title in enumerate(STATUS_COLUMNS):
        lines = [line for row in cells for line in row[i]]
        words = max(len(w) for line in [*lines, title] for w in line.split())
        longest = max(map(len, lines), default=0)
        figures = longest if title in STATUS_FIGURES else 0
        # Last of all, a name (a box's, a profile's) gives up its middle: the other columns' words
        # stay whole.
        names = max(len(title), min(words, SHORTEST_NAME)) if i == 0 else words
        widths.append((max(len(title), longest), max(longest, words), max(figures, words), words, names))
    room = c.width - 2 * (len(widths) - 1)
    fitted = fit_widths(widths, room)
    for title, width in zip(STATUS_COLUMNS, fitted, strict=True):
        t.add_column(title, width=width, overflow="fold")
    shortened = False
    for row in cells:
        box = [shorten_middle(line, fitted[0]) for line in row[0]]
        shortened = shortened or box != row[0]
        t.add_row(*("\n".join(escape(line) for line in cell) for cell in [box, *row[1:]]))
    if sum(fitted) > room:  # a terminal too narrow for the words: let it wrap the lines, whole
        from rich.console import Console

        c = Console(file=sys.stderr, highlight=False, soft_wrap=True, width=sum(fitted) + c.width - room)
    c.print(t)
    if shortened:
        c.print("(names shortened in their middle: `status --json` has them whole)")
    for n in notes:
        c.print(n)
    for r in rows:
        for line in alert_lines(r):
            c.print(f"[bold red]{esc(line)}[/]")


def alert_lines(r: dict[str, object]) -> list[str]:
    """One line per active alert of a status row, and one for probes gone stale: under the table,
    so they survive in scrollback."""
    box = str(r["box"])
    out = []
    alerts = r.get("alerts")
    for a in alerts if isinstance(alerts, list) else []:
        if isinstance(a, dict):
            out.append(f"{box}: {a.get('kind')} {a.get('subject')}: {a.get('detail')}")
    stale = r.get("stale_probes")
    if isinstance(stale, list) and stale:
        out.append(f"{box}: no fresh reading from {', '.join(map(str, stale))} (last good values shown)")
    return out


SHORTEST_NAME = 12
"""A box name is shortened (in its middle) to no fewer characters than this."""


def shorten_middle(text: str, width: int) -> str:
    """`text` in `width` characters: its head, "…", and its tail (where the names of one fan-out's
    boxes differ), favoured by a character."""
    if len(text) <= width:
        return text
    keep = max(width - 1, 2)
    head = (keep - 1) // 2
    return f"{text[:head]}…{text[len(text) - (keep - head) :]}"


def fit_widths(columns: Sequence[tuple[int, ...]], room: int) -> list[int]:
    """Column widths within `room`, from each column's natural width and the floors it may be
    narrowed to, in turn (wrapped titles; then cells wrapped at their spaces, a figure kept with its
    unit; then only never through a word; then names shortened): at each floor the widest column
    gives a character at a time; past the last floor, wider than `room`."""
    widths = [c[0] for c in columns]
    for floor in range(1, len(columns[0]) if columns else 0):
        while sum(widths) > room:
            narrowable = [i for i, w in enumerate(widths) if w > columns[i][floor]]
            if not narrowable:
                break
            widths[max(narrowable, key=lambda i: widths[i])] -= 1
    return widths


def artifacts(box: str, listing: pb.ListArtifactsResponse) -> None:
    t = _table(f"{box}: {len(listing.claims)} claims, manifest {listing.manifest_digest[:16]}…")
    for col in ("path", "bytes", "blake3", "durable", "proof", "sealed"):
        t.add_column(col)
    for c in listing.claims:
        sealed = time.strftime("%H:%M:%S", time.localtime(c.sealed_at_unix_ns / 1e9))
        durable = "yes" if c.durable else esc(f"no {c.push_error}")
        t.add_row(
            esc(c.path),
            str(c.size),
            c.blake3[:16] + "…",
            durable + (" (only: box copy deleted)" if c.durable_only else ""),
            esc(proof_kind(c)),
            sealed,
        )
    _console().print(t)
    states = {
        pb.PENDING_WRITING: "being written",
        pb.PENDING_CHANGED: "not sealed as it is now",
        pb.PENDING_TEMP: "temp name",
        pb.PENDING_UNCLAIMABLE: "unclaimable",
    }
    for p in listing.pending:
        warn(f"{safe(p.path)}: {states.get(p.state, 'pending')}: {safe(p.detail)}")
    if listing.excluded_files:
        shown = ", ".join(esc(p) for p in listing.excluded_sample)
        more = " …" if listing.excluded_files > len(listing.excluded_sample) else ""
        info(f"{listing.excluded_files} files excluded by the patterns given at up: {shown}{more}")


def _transfer_bars() -> tuple[Console, Progress]:
    """The console and its transfer bars (bytes, rate, time left), drawn on a terminal only."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    c = _console()
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=c,
        transient=True,
        disable=not c.is_terminal,
    )
    return c, bar


@contextmanager
def transfer_progress() -> Iterator[TransferProgress]:
    """A bar for the whole pull (bytes, rate, time left), and one line per finished file."""
    c, bar = _transfer_bars()
    with bar:
        yield TransferProgress(c, bar)


class TransferProgress:
    def __init__(self, console: Console, bar: Progress) -> None:
        self.console, self.bar = console, bar
        self.done: set[str] = set()
        self.got: dict[str, int] = {}
        self.task: TaskID | None = None

    def start(self, files: int, total_bytes: int) -> None:
        self.task = self.bar.add_task(f"pulling {files} files", total=total_bytes)

    def update(self, path: str, got: int, size: int) -> None:
        if self.task is not None:
            self.bar.advance(self.task, got - self.got.get(path, 0))
        self.got[path] = got
        if got >= size and path not in self.done:
            self.done.add(path)
            self.console.print(f"  \\[{len(self.done)}] {esc(path)} ({human_bytes(size)})")


def at_risk_line(box: str, p: pb.DrainProgress) -> str:
    """What a kill of the box now would lose, in one line (plain text, not escaped)."""
    if not p.at_risk_files and not p.pending:
        return f"{box}: nothing at risk: every claim is durable and nothing waits to be sealed"
    parts = []
    if p.at_risk_files:
        s = "" if p.at_risk_files == 1 else "s"
        parts.append(f"{p.at_risk_files} file{s} ({human_bytes(p.at_risk_bytes)}) not durable yet")
        if p.estimated_s < 0:
            parts.append("time to push unknown (no push measured yet)")
        else:
            parts.append(f"about {human_duration(p.estimated_s)} at {human_rate(p.push_bytes_per_s)}")
    if p.pending:
        s = "y" if p.pending == 1 else "ies"
        parts.append(f"{p.pending} entr{s} not sealed yet (being written, changed or temp-named)")
    return f"{box}: at risk: " + "; ".join(parts)


def drain_report(rep: DrainReport) -> None:
    p, c = rep.last, _console()
    style = "green" if rep.safe else "bold red"
    c.print(f"[{style}]{esc(at_risk_line(rep.box, p))}[/]")
    for claim in p.at_risk:
        why = f"push error: {claim.push_error}" if claim.push_error else "not pushed yet"
        c.print(f"  {esc(claim.path)} ({human_bytes(claim.size)}): {esc(why)}")
    if p.at_risk_files > len(p.at_risk):
        c.print(f"  … and {p.at_risk_files - len(p.at_risk)} more (`boxwarden artifacts {esc(rep.box)}`)")
    if p.pending:
        c.print(f"  entries not sealed yet: `boxwarden artifacts {esc(rep.box)}` lists them")
    if rep.waited and not rep.safe:
        c.print(
            f"still at risk after {human_duration(rep.elapsed_s)} (the drain's timeout was "
            f"{rep.timeout_s}s); the sidecar keeps retrying the pushes"
        )


PLAIN_EVERY_S = 10.0


@contextmanager
def drain_progress(box: str) -> Iterator[Callable[[pb.DrainProgress], None]]:
    """What `drain --wait` shows while it waits: on a terminal a transient bar on stderr (bytes
    made durable of the most seen at risk), elsewhere a plain line when the figures change (at
    least every 10 s while they do not)."""
    c = _console()
    if not c.is_terminal:
        shown: tuple[int, ...] = ()
        shown_at = 0.0

        def line(p: pb.DrainProgress) -> None:
            nonlocal shown, shown_at
            figures = (p.at_risk_files, p.pending, p.at_risk_bytes)
            if p.done or (figures == shown and time.monotonic() - shown_at < PLAIN_EVERY_S):
                return  # the last word is the report's
            shown, shown_at = figures, time.monotonic()
            c.print(safe(at_risk_line(box, p)), markup=False)

        yield line
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=c, transient=True
    )
    with bar:
        task = bar.add_task(f"draining {esc(box)}", total=None)
        peak = 0

        def update(p: pb.DrainProgress) -> None:
            nonlocal peak
            peak = max(peak, p.at_risk_bytes)
            what = esc(at_risk_line(box, p))
            bar.update(task, description=what, total=peak or None, completed=peak - p.at_risk_bytes)

        yield update


def pull_report(rep: PullReport) -> None:
    line = (
        f"pulled into {esc(str(rep.root))}: {len(rep.fetched)} fetched ({human_bytes(rep.bytes_fetched)}), "
        f"{len(rep.skipped)} already present; manifest {rep.manifest.digest[:16]}…"
    )
    if rep.bytes_discarded:
        line += (
            f"; {human_bytes(rep.bytes_discarded)} more received and discarded "
            "(a resumed copy did not match, so it was fetched again from the start)"
        )
    if rep.parts_removed:
        n = rep.parts_removed
        line += f"; removed {n} leftover partial cop{'y' if n == 1 else 'ies'} that no claim needs"
    info(line)
    if rep.source_detail:
        info(f"read from durable storage: {esc(rep.source_detail)}")
    if rep.replaced:
        info(
            f"replaced {len(rep.replaced)} file(s) an earlier pull put here with the box's newer bytes "
            "(the box changed them since; durable storage, too, keeps only the newest): "
            f"{_some(rep.replaced)}"
        )
    if rep.displaced:
        info(
            f"moved {len(rep.displaced)} file(s) an earlier pull put here to .bw-replaced/<path>.<blake3>: "
            "the box has a file where they had their directory now, or a directory where they were: "
            f"{_some(rep.displaced)}"
        )
    if rep.retired:
        info(
            f"kept {len(rep.retired)} file(s) an earlier pull put here that the box no longer claims "
            "(deleted, renamed or released there; their durable copies remain), listed as retired in "
            f"MANIFEST.json: {_some(rep.retired)}"
        )
    if rep.extra_local:
        warn(
            f"{len(rep.extra_local)} file(s) here were not put here by a pull of this box, or changed since "
            f"(verify reports them EXTRA; pull never deletes them): {_some(rep.extra_local)}"
        )


def _some(paths: Sequence[str], shown: int = 20) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(esc(p) for p in paths[:shown]) + more


def verify_report(rep: VerifyReport) -> None:
    if rep.ok:
        info(
            f"[bold green]VERIFIED[/] {esc(str(rep.root))}: {rep.files} files, {human_bytes(rep.bytes)}, "
            f"manifest {rep.manifest_digest[:16]}…; marker written: {esc(str(rep.marker_path))}"
        )
        return
    _console().print(f"[bold red]NOT VERIFIED[/] {esc(str(rep.root))}: {len(rep.reasons)} problem(s)")
    reasons(rep.reasons)


def verdict(v: Verdict, *, dry_run: bool) -> None:
    c = _console()
    t = _table(f"down {v.box}: evidence")
    t.add_column("check")
    t.add_column("result")
    t.add_column("detail")
    for ch in v.checks:
        t.add_row(ch.name, "[green]ok[/]" if ch.ok else "[red]FAIL[/]", esc(ch.detail))
    c.print(t)
    if v.allowed:
        how = (
            f"`down {v.box} --confirm {v.box} --box-gone` first reads every durable copy back here"
            if v.gone is not None
            else f"`down {v.box} --confirm {v.box}` first proves every durable copy again by reading it back"
        )
        tail = (
            f" (dry run: nothing was done; {how}, and refuses if one no longer hashes equal)"
            if dry_run
            else ""
        )
        c.print(f"[bold green]ALLOWED[/]: {v.box} may be torn down{tail}")
    else:
        c.print(f"[bold red]REFUSED[/]: {v.box} must not be torn down yet:")
        reasons(v.reasons)


def teardown(res: TeardownResult) -> None:
    m = res.meter
    meter = esc(m.detail) if m else "not attempted"
    info(
        f"[bold]{esc(res.box)}[/]: deleted {len(res.deleted)} verified box-side copies, "
        f"kept {len(res.kept)}; "
        f"sidecar {'[green]gone[/]' if res.sidecar_gone else '[red]not seen gone[/]'}; "
        f"meter stop: {meter}; {'[bold green]gone[/]' if res.gone else '[bold red]NOT proven gone[/]'}; "
        f"audit record #{res.audit_id}"
    )
    if res.judged:
        info(f"judged: {esc(res.judged)}")
    for k in res.kept:
        warn(f"kept on the box: {k}")
    if m is not None and m.note:
        warn(f"about this platform's meter stop: {m.note}")


def manual_steps(box: str, steps: str) -> None:
    c = _console()
    c.print(f"[bold yellow]stop the meter of {box} by hand[/] (boxwarden cannot do it on this platform):")
    c.print(safe(steps, multiline=True), markup=False)


def ask_done() -> bool:
    answer = str(_console().input("Type [bold]done[/] once you did these steps (anything else: not done): "))
    return answer.strip().lower() == "done"


def confirm_prompt(box: str) -> str:
    c = _console()
    return str(c.input(f"Type the box name ([bold]{box}[/]) to confirm teardown: ")).strip()


# -- profiles --------------------------------------------------------------------------------------


def _yes(v: bool) -> str:
    return "[green]yes[/]" if v else "[red]NO[/]"


def findings(fs: Sequence[Finding]) -> None:
    for f in fs:
        if f.level == "warn":
            warn(f"{f.check}: {f.message}")
        elif f.level == "error":
            error(f"{f.check}: {f.message}")


def platform_notices(p: Profile) -> None:
    """Once per box: what can destroy data on this platform, and what helps there."""
    c = _console()
    if p.danger_clocks:
        c.print(f"[bold yellow]danger clocks on {esc(p.name)}[/] (verified {esc(p.verified)}):")
        for d in p.danger_clocks:
            c.print(
                f"  [yellow]{esc(d.name)}[/]: {esc(d.after)} → {esc(d.effect)} "
                f"[dim](verified {esc(d.verified)})[/]"
            )
    labels = {"pip_index": "pip index mirror", "hf_endpoint": "Hugging Face mirror", "note": "network"}
    for key, value in p.mirrors.items():
        c.print(safe(f"  {labels.get(key, key)}: {value}"), markup=False)


def profile_summary(p: Profile) -> dict[str, object]:
    return {
        "name": p.name,
        "kind": p.kind,
        "description": p.description,
        "meter_stop": p.meter_stop.verb,
        "irreversible": p.meter_stop.irreversible,
        "spot": p.spot.available,
        "verified": p.verified,
    }


def profile_list(ps: Sequence[Profile]) -> None:
    t = _table("profiles")
    for col in ("name", "kind", "meter stop", "irreversible", "spot", "verified"):
        t.add_column(col, no_wrap=True)
    t.add_column("description")
    for p in ps:
        ms = p.meter_stop
        t.add_row(
            esc(p.name),
            esc(p.kind),
            esc(ms.verb),
            "yes" if ms.irreversible else "no",
            "yes" if p.spot.available else "no",
            esc(p.verified),
            esc(p.description),
        )
    _console().print(t)


def profile_json(p: Profile) -> dict[str, object]:
    ms = p.meter_stop
    return {
        **profile_summary(p),
        "meter_stop": {
            "verb": ms.verb,
            "irreversible": ms.irreversible,
            "mode": ms.mode,
            "argv": list(ms.argv),
            "manual": ms.manual,
            "timeout_s": ms.timeout_s,
            "note": ms.note,
        },
        "storage": [{**t.__dict__, "survives_meter_stop": p.survives_meter_stop(t)} for t in p.storage],
        "spot": p.spot.__dict__,
        "danger_clocks": [d.__dict__ for d in p.danger_clocks],
        "mirrors": dict(p.mirrors),
        "detach": p.detach,
        "inode_cap": p.inode_cap,
        "gotchas": list(p.gotchas),
    }


def profile_show(p: Profile) -> None:
    c = _console()
    ms = p.meter_stop
    c.print(
        f"[bold]{esc(p.name)}[/] ({esc(p.kind)}): {esc(p.description)}  "
        f"[dim]facts verified {esc(p.verified)}[/]"
    )
    irreversible = (
        "[bold red]IRREVERSIBLE[/]: it destroys the box's disks" if ms.irreversible else "reversible"
    )
    c.print(f"meter stop: [bold]{esc(ms.verb)}[/] — {irreversible} [dim](verified {esc(ms.verified)})[/]")
    if ms.mode == "argv":
        gone_when = " ".join(ms.poll.argv) if ms.poll else ""
        c.print(safe(f"  boxwarden runs: {' '.join(ms.argv)}; gone when: {gone_when}"), markup=False)
    elif ms.mode == "manual":
        c.print(safe(f"  by hand: {ms.manual}", multiline=True), markup=False)
    if ms.note:
        c.print(safe(f"  note: {ms.note}", multiline=True), markup=False)
    t = _table(f"what survives on {esc(p.name)}")
    for col in (
        "tier",
        "path",
        "survives stop",
        f"survives {esc(ms.verb)}" if ms.irreversible else "survives destroy",
        "cap",
    ):
        t.add_column(col)
    for tier in p.storage:
        durable = " (durable default)" if tier.durable_default else ""
        t.add_row(
            esc(tier.name + durable),
            esc(tier.path),
            _yes(tier.survives_stop),
            _yes(tier.survives_destroy),
            esc(tier.cap),
        )
    c.print(t)
    if p.spot.available and p.spot.signal:
        c.print(safe(f"spot: yes — {p.spot.signal}, then killed after ~{p.spot.grace_s}s"), markup=False)
    elif p.spot.available:
        c.print("spot: yes — preempted with no signal and no grace: only pushed checkpoints survive")
    else:
        c.print("spot: not offered")
    c.print(safe(f"detach: {p.detach}{' — ' + p.detach_note if p.detach_note else ''}"), markup=False)
    if p.inode_cap or p.inode_note:
        c.print(safe(f"inodes: {p.inode_cap or ''} {p.inode_note}".rstrip()), markup=False)
    platform_notices(p)
    for g in p.gotchas:
        c.print(safe(f"  • {g}", multiline=True), markup=False)


# -- fleet operations (`pull --all`, `down --all`) ----------------------------------------------------

if TYPE_CHECKING:
    from collections.abc import Collection

    from controller.fleetops import DownOutcome, PullOutcome


@contextmanager
def fleet_progress(names: Sequence[str]) -> Iterator[FleetProgress]:
    """`pull --all`: on a terminal, a bar per box and one for all of them (bytes, rate, time left);
    everywhere, a line per finished file (named with its box) and one per box as it ends."""
    c, bar = _transfer_bars()
    with bar:
        yield FleetProgress(c, bar, names)


class FleetProgress:
    """The bars of `pull --all`. The total counts the bytes of the boxes whose claims lists arrived."""

    def __init__(self, console: Console, bar: Progress, names: Sequence[str]) -> None:
        self.console, self.bar = console, bar
        self.total = bar.add_task(f"all {len(names)} boxes", total=None)
        self.tasks = {n: bar.add_task(f"{esc(n)}: reaching", total=None) for n in names}
        self.sizes: dict[str, int] = {}

    def box(self, name: str) -> BoxTransfer:
        return BoxTransfer(self, name)

    def started(self, name: str, files: int, total_bytes: int) -> None:
        self.sizes[name] = total_bytes
        self.bar.update(self.tasks[name], description=f"{esc(name)}: {files} files", total=total_bytes)
        self.bar.update(self.total, total=sum(self.sizes.values()))

    def advance(self, name: str, n: int) -> None:
        self.bar.advance(self.tasks[name], n)
        self.bar.advance(self.total, n)

    def ended(self, outcome: PullOutcome) -> None:
        name = outcome.box
        what = "[red]failed[/]" if outcome.error else "[green]done[/]"
        self.bar.update(self.tasks[name], description=f"{esc(name)}: {what}")
        self.console.print(f"{esc(name)}: {what}")


class BoxTransfer:
    """One box's part of a FleetProgress (a controller.pull.Progress)."""

    def __init__(self, fleet: FleetProgress, name: str) -> None:
        self.fleet, self.name = fleet, name
        self.done: set[str] = set()
        self.got: dict[str, int] = {}

    def start(self, files: int, total_bytes: int) -> None:
        self.fleet.started(self.name, files, total_bytes)

    def update(self, path: str, got: int, size: int) -> None:
        self.fleet.advance(self.name, got - self.got.get(path, 0))
        self.got[path] = got
        if got >= size and path not in self.done:
            self.done.add(path)
            line = f"  {esc(self.name)} \\[{len(self.done)}] {esc(path)} ({human_bytes(size)})"
            self.fleet.console.print(line)


def fleet_pull_report(outcomes: Sequence[PullOutcome]) -> None:
    failed = [o for o in outcomes if o.error]
    if not outcomes:
        info("no box is up: nothing to pull")
        return
    for o in outcomes:
        if o.report is not None:
            info(f"[bold]{esc(o.box)}[/]:")
            pull_report(o.report)
    for o in failed:
        error(f"{o.box}: {o.error}")
    style = "bold red" if failed else "bold green"
    tail = f"; {len(failed)} failed: {', '.join(o.box for o in failed)}" if failed else ""
    info(f"[{style}]pulled {len(outcomes) - len(failed)} of {len(outcomes)} boxes[/]{esc(tail)}")


def fleet_verdicts(outcomes: Sequence[DownOutcome], *, dry_run: bool) -> None:
    """`down --all`: each box's verdict in a line (the reasons of a refused one under it)."""
    c = _console()
    passing = [o for o in outcomes if o.outcome == "allowed"]
    c.print(
        f"down --all: {len(outcomes)} boxes not down; {len(passing)} pass the gate"
        + (" (dry run: nothing was done; `down NAME --dry-run` shows a box's evidence)" if dry_run else "")
    )
    for o in outcomes:
        if o.outcome == "allowed":
            c.print(f"  [bold green]ALLOWED[/] {esc(o.box)}")
        elif o.outcome == "refused":
            c.print(f"  [bold red]REFUSED[/] {esc(o.box)}: {esc(', '.join(o.codes))}")
            reasons(o.reasons)
        else:
            c.print(f"  [bold red]ERROR[/] {esc(o.box)}: {esc_block(o.error, '      ')}")


def fleet_confirm_prompt(names: Sequence[str]) -> str:
    n = len(names)
    boxes = "box" if n == 1 else "boxes"
    return str(
        _console().input(f"Tear down {n} {boxes}: [bold]{esc(', '.join(names))}[/]? Type {n} to confirm: ")
    ).strip()


def fleet_down_report(outcomes: Sequence[DownOutcome], *, shown: Collection[str] = ()) -> None:
    """After `down --all`'s teardowns: each one's line, then the boxes left up and why (only their
    codes for the boxes in `shown`, whose reasons were listed with the verdicts)."""
    for o in outcomes:
        if o.teardown is not None:
            teardown(o.teardown)
    rest = [o for o in outcomes if o.outcome != "torn-down"]
    for o in rest:
        if o.outcome == "refused":
            _console().print(f"[bold red]not torn down[/] {esc(o.box)}: {esc(', '.join(o.codes))}")
            if o.box not in shown:
                if o.error:
                    info(f"  {esc_block(o.error)}")
                reasons(o.reasons)
        else:
            error(f"{o.box}: not torn down: {o.error}")
    done = [o.box for o in outcomes if o.outcome == "torn-down"]
    style = "bold red" if rest else "bold green"
    tail = f": {', '.join(done)}" if done else ""
    info(f"[{style}]torn down {len(done)} of {len(outcomes)} boxes[/]{esc(tail)}")
