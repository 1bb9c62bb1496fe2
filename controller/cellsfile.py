"""Cell-queue files: `boxwarden run NAME --queue cells.toml` reads one into plain typed values, and
`run NAME --cell a --cell b -- CMD...` builds the same values from flags. This module owns that
reading and every rule a queue must meet before anything is sent to the box.

The file (cells.toml)::

    name = "lr-sweep"          # optional; default: the file's name without .toml
    restart = "on-failure"     # optional: "never" or "on-failure"; default: the --restart flag
    max_restarts = 3           # optional: an integer, at least 1
    restart_backoff = 10.0     # optional: seconds, 0.1 to 300

    [defaults]                 # optional; what every cell gets unless it says otherwise
    command = ["python", "train.py", "--out", "/root/ckpt/{cell}"]
    cwd = "/root/work"         # optional; default: the sidecar's workdir
    env = { WANDB_MODE = "offline" }

    [[cell]]                   # one per cell, in run order; at least one, at most 1000
    name = "lr-1e-3"           # required; letters, digits, '.', '_' or '-'; each cell its own
    env = { LR = "1e-3" }      # merged over defaults.env (the cell's value wins)
    # command = [...]          # replaces defaults.command
    # cwd = "..."              # replaces defaults.cwd

    [[cell]]
    name = "lr-3e-4"
    env = { LR = "3e-4" }

- `command` is a list of arguments, never a shell string (`["sh", "-c", "..."]` if you need a
  shell); every cell needs one, its own or the one in [defaults].
- `{cell}` in `command`, `cwd` and `env` values is replaced by the cell's name on the box.
- `cwd` is an absolute path on the box.
- `env` holds strings only (quote numbers: `LR = "1e-3"`); names are letters, digits and '_', not
  starting with a digit. BOXWARDEN_JOB_ID, BOXWARDEN_CELL and BOXWARDEN_RESUME_FROM are the
  sidecar's to set.
- No NUL byte anywhere; no field but these.

Every problem is one UsageError naming the file, the [[cell]] (its line, its number counted from 1
and its name when known) and the field, and saying what to do.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3

from controller import boxes
from controller.errors import UsageError
from controller.tomlfields import Fields, read_text

RESTARTS = ("never", "on-failure")
MAX_CELLS = 1000
MAX_RESTARTS = 2**31 - 1  # the sidecar's int32 field
BACKOFF_S = (0.1, 300.0)  # as `run --restart-backoff`
MAX_FILE_BYTES = 4 << 20
# The sidecar sets these in every job's environment: a queue must not.
SIDECAR_ENV = ("BOXWARDEN_JOB_ID", "BOXWARDEN_CELL", "BOXWARDEN_RESUME_FROM")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SHELL_HINT = 'a list of arguments, never a shell string: ["sh", "-c", "..."] if you need a shell'


@dataclass(frozen=True)
class QueuedCellSpec:
    """One cell as it will run: "{cell}" in `argv`, `cwd` and `env` values is left for the sidecar
    to replace; `cwd` is "" for the sidecar's workdir; `env` is added to the job's environment."""

    name: str
    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str]
    box: str = ""  # a plan's cell: the box it runs on ("" or "any": whichever the plan spreads it to)
    line: int | None = field(default=None, compare=False)  # its [[cell]] header's line, where known


@dataclass(frozen=True)
class CellsFile:
    """A queue: its cells in run order, and its restart policy (None: the command line's flag)."""

    name: str
    cells: tuple[QueuedCellSpec, ...]
    restart: str | None
    max_restarts: int | None
    restart_backoff: float | None


def load_cells(path: Path) -> CellsFile:
    """Read and validate a queue file: a regular file of UTF-8 TOML, checked on the open file before
    reading (a FIFO or /dev/zero would never end)."""
    text = read_text(path, what="the queue file", option="--queue", max_bytes=MAX_FILE_BYTES)
    return parse_cells(text, file=str(path), default_name=path.stem)


def parse_cells(text: str, *, file: str, default_name: str) -> CellsFile:
    """Validate a queue file's text; `file` names it in messages, `default_name` is the queue's
    name when the file gives none."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{file}: not valid TOML: {e}") from e
    top = Table(data, file=file)
    cells = cells_of(top, text, file=file, default_name=default_name)
    top.done()
    return cells


def cells_of(top: Table, text: str, *, file: str, default_name: str, plan: bool = False) -> CellsFile:
    """The queue part of a file (name, restart policy, [defaults], [[cell]]) read from its top
    table `top` (the caller reads the rest, then calls top.done()). `plan`: a cell may name its box."""
    if top.has("name"):
        name = _checked(top, "name", top.text("name"), "queue name")
    else:
        name = _stem_name(file, default_name)
    restart = top.choice("restart", RESTARTS)
    max_restarts = top.integer("max_restarts", required=False, minimum=1)
    if max_restarts is not None and max_restarts > MAX_RESTARTS:
        raise top.fail("max_restarts", f"must be at most {MAX_RESTARTS}, not {max_restarts}")
    backoff = top.seconds("restart_backoff", *BACKOFF_S)

    defaults = _Defaults()
    if top.has("defaults"):
        line = _one(header_lines(text, "defaults", array=False))
        d = Table(top.get_table("defaults"), file=file, prefix="defaults", line=line)
        defaults = _Defaults(d.argv("command"), d.cwd("cwd"), d.env("env"))
        d.done()

    rows = top.rows("cell")
    lines = header_lines(text, "cell", array=True)
    if len(lines) != len(rows):
        lines = []  # cells given another way (an inline array), or a header inside a string
    cells: list[QueuedCellSpec] = []
    first: dict[str, int] = {}  # cell name -> its index
    for i, row in enumerate(rows):
        t = Table(row, file=file, line=lines[i] if lines else None, cell=i + 1)
        cell = _cell(t, defaults, plan=plan)
        if cell.name in first:
            j = first[cell.name]
            at = f" (line {lines[j]})" if lines else ""
            raise t.fail(
                "name", f"{cell.name!r} is also the name of [[cell]] {j + 1}{at}; give each cell its own"
            )
        first[cell.name] = i
        cells.append(cell)
    return CellsFile(name, tuple(cells), restart, max_restarts, backoff)


def cells_from_flags(cells: Sequence[str], argv: Sequence[str], *, name: str | None) -> CellsFile:
    """The queue of `run NAME --cell a --cell b -- CMD...`: every cell runs `argv` ("{cell}" left in
    place for the sidecar). Without `name`, the queue is named from a digest of the cells and argv,
    so that the same command line names the same queue again (and so continues it)."""
    if not cells:
        raise UsageError("no --cell given; name at least one cell to queue")
    if len(cells) > MAX_CELLS:
        raise UsageError(
            f"{len(cells)} cells; a queue holds at most {MAX_CELLS}: split them over several queues"
        )
    seen: set[str] = set()
    for cell in cells:
        boxes.check_name(cell, "cell")
        if cell in seen:
            raise UsageError(f"--cell {cell} is given twice; give each cell once")
        seen.add(cell)
    if not argv or not argv[0]:
        raise UsageError("no command given; put it after --: run NAME --cell a -- python train.py ...")
    for i, arg in enumerate(argv):
        if "\0" in arg:
            raise UsageError(f"argument {i} of the command ({arg!r}) contains a NUL byte; remove it")
    if name is None:
        digest = blake3.blake3(json.dumps([list(cells), list(argv)]).encode()).hexdigest()
        name = "cells-" + digest[:10]
    else:
        boxes.check_name(name, "queue name")
    specs = tuple(QueuedCellSpec(cell, tuple(argv), "", {}) for cell in cells)
    return CellsFile(name, specs, None, None, None)


@dataclass(frozen=True)
class _Defaults:
    argv: tuple[str, ...] | None = None
    cwd: str | None = None
    env: Mapping[str, str] | None = None


def _cell(t: Table, defaults: _Defaults, *, plan: bool = False) -> QueuedCellSpec:
    name = _checked(t, "name", t.text("name"), "cell name")
    t.name = name  # every message from here on names the cell
    argv = t.argv("command") or defaults.argv
    if argv is None:
        raise t.fail(
            "command",
            'missing, and [defaults] has none; add command = ["python", "train.py", ...] to this '
            "[[cell]] or to [defaults]",
        )
    cwd = t.cwd("cwd")
    env = {**(defaults.env or {}), **(t.env("env") or {})}
    box = t.text("box", required=False, default="") if plan else ""
    t.done()
    return QueuedCellSpec(name, argv, (defaults.cwd or "") if cwd is None else cwd, env, box, t.line)


def _checked(t: Table, key: str, value: str, what: str) -> str:
    try:
        return boxes.check_name(value, what)
    except UsageError as e:
        raise t.fail(key, str(e)) from None


def _stem_name(file: str, stem: str) -> str:
    try:
        return boxes.check_name(stem, "queue name (the file's name)")
    except UsageError as e:
        raise UsageError(f'{file}: {e}; or add name = "..." to the file') from None


class Table(Fields):
    """Fields with this file's messages ("cells.toml:14: [[cell]] 3 ('lr-1e-3'): field env: ...")
    and the getters a queue file needs that Fields lacks."""

    def __init__(
        self,
        data: Mapping[str, Any],
        *,
        file: str,
        prefix: str = "",
        line: int | None = None,
        cell: int | None = None,
        section: str = "cell",
    ) -> None:
        super().__init__(data, prefix, file)
        self.data, self.file, self.prefix, self.line, self.cell = data, file, prefix, line, cell
        self.section = section  # the [[section]] the table is one of (with `cell`: its number)
        self.name = ""  # the cell's name, once read and checked

    def fail(self, key: str, problem: str) -> UsageError:
        where = f"{self.file}:{self.line}" if self.line else self.file
        if self.cell is not None:
            where += f": [[{self.section}]] {self.cell}" + (f" ({self.name!r})" if self.name else "")
        field = f"{self.prefix}.{key}" if self.prefix else key
        return UsageError(f"{where}: field {field}: {problem}")

    def has(self, key: str) -> bool:
        return key in self.data

    def text_list(self, key: str) -> tuple[str, ...]:
        """A list of non-empty strings without NUL bytes; () if absent."""
        v = self._get(key, list, "a list of strings", False)
        if v is None:
            return ()
        for i, item in enumerate(v):
            if not isinstance(item, str) or not item or "\0" in item:
                raise self.fail(f"{key}[{i}]", f"must be a non-empty string without NUL bytes, not {item!r}")
        return tuple(v)

    def number_or_none(self, key: str) -> float | None:
        v = self._get(key, (int, float), "a number", False)
        return None if v is None else float(v)

    def choice(self, key: str, choices: Sequence[str]) -> str | None:
        v = self._get(key, str, "a string", False)
        if v is not None and v not in choices:
            raise self.fail(key, f"{v!r} is not one of {', '.join(choices)}")
        return None if v is None else str(v)

    def seconds(self, key: str, lo: float, hi: float) -> float | None:
        v = self._get(key, (int, float), "a number of seconds", False)
        if v is None:
            return None
        if not math.isfinite(v) or not lo <= v <= hi:
            raise self.fail(key, f"must be {lo:g} to {hi:g} seconds, not {v}")
        return float(v)

    def get_table(self, key: str) -> Mapping[str, Any]:
        v: Mapping[str, Any] = self._get(key, dict, f"a [{key}] table", True)
        return v

    def rows(self, key: str) -> list[Mapping[str, Any]]:
        """An array of tables, at least one and at most MAX_CELLS."""
        v = self.data.get(key)
        if isinstance(v, dict):
            raise self.fail(key, f"is a single [{key}] table; write [[{key}]], with double brackets")
        rows = self._get(key, list, f"at least one [[{key}]] table", True)
        if not rows:
            raise self.fail(key, f"is empty; add at least one [[{key}]] table")
        if not all(isinstance(r, dict) for r in rows):
            raise self.fail(key, f"must be an array of [[{key}]] tables")
        if len(rows) > MAX_CELLS:
            raise self.fail(
                key, f"{len(rows)} cells; a queue holds at most {MAX_CELLS}: split it over several files"
            )
        return list(rows)

    def argv(self, key: str) -> tuple[str, ...] | None:
        """A command: a non-empty list of non-empty strings without NUL bytes; None if absent."""
        if isinstance(self.data.get(key), str):
            self._seen.add(key)  # read: not reported as unknown as well
            raise self.fail(key, f"is the string {self.data[key]!r}; give {SHELL_HINT}")
        v = self._get(key, list, SHELL_HINT, False)
        if v is None:
            return None
        if not v:
            raise self.fail(key, 'is empty; give the program and its arguments, like ["python", "train.py"]')
        for i, arg in enumerate(v):
            if not isinstance(arg, str):
                raise self.fail(
                    f"{key}[{i}]", f"must be a string, not {type(arg).__name__} {arg!r}; quote it"
                )
            if not arg:
                raise self.fail(f"{key}[{i}]", "is empty; remove it, or give the argument")
            if "\0" in arg:
                raise self.fail(f"{key}[{i}]", f"{arg!r} contains a NUL byte; remove it")
        return tuple(v)

    def cwd(self, key: str) -> str | None:
        v = self._get(key, str, "an absolute path on the box", False)
        if v is None:
            return None
        if "\0" in v:
            raise self.fail(key, f"{v!r} contains a NUL byte; remove it")
        if not v.startswith("/"):
            raise self.fail(key, f"must be an absolute path on the box (starting with /), not {v!r}")
        return str(v)

    def env(self, key: str) -> dict[str, str] | None:
        """A table of environment variables: valid names, string values, none of the sidecar's."""
        v = self._get(key, dict, 'a table of NAME = "value" strings', False)
        if v is None:
            return None
        for k, value in v.items():
            if not ENV_NAME.fullmatch(k):
                raise self.fail(
                    f"{key}[{k!r}]", "is not an environment variable name: use letters, digits and '_'"
                )
            field = f"{key}.{k}"
            if k in SIDECAR_ENV:
                raise self.fail(field, "is set by the sidecar for every job; remove it")
            if not isinstance(value, str):
                shown = f"{type(value).__name__} {value!r}"
                raise self.fail(field, f'must be a string, not {shown}; quote it: {k} = "..."')
            if "\0" in value:
                raise self.fail(field, f"{value!r} contains a NUL byte; remove it")
        return dict(v)


def header_lines(text: str, key: str, *, array: bool) -> list[int]:
    """The line numbers (from 1) of the `[[key]]` (or `[key]`) header lines. Only "\\n" ends a TOML
    line (U+2028 or U+0085 inside a string does not), so the text is split on it alone."""
    name = rf"""[ \t]*(?:{key}|"{key}"|'{key}')[ \t]*"""
    header = re.compile(rf"[ \t]*\[\[{name}\]\]" if array else rf"[ \t]*\[{name}\]")
    tail = re.compile(r"[ \t]*(?:#.*)?\r?")
    found = []
    for n, line in enumerate(text.split("\n"), 1):
        m = header.match(line)
        if m and tail.fullmatch(line, m.end()):
            found.append(n)
    return found


def _one(lines: list[int]) -> int | None:
    return lines[0] if len(lines) == 1 else None
