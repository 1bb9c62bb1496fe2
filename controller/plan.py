"""Fan-out plans: one file (plan.toml) naming the boxes of an ablation and its cells, read into plain
typed values and checked before anything is started. `fanout up` acts on a plan (controller.fanout).

The file::

    name = "lr-sweep"            # optional; default: the file's name. Each box's queue has this name.
    durable = "s3://bucket/runs" # optional; every box's durable store (default: each box's own)
    roster = ["lr-1", "lr-2"]    # optional; the cells the evidence must hold (default: every cell)
    restart = "on-failure"       # optional, and max_restarts, restart_backoff: as in a queue file

    [defaults]                   # as in a queue file: command, cwd, env
    command = ["python", "train.py", "--out", "ckpt/{cell}"]

    [[box]]                      # one per box, at least one
    name = "gpu1"
    profile = "runpod"           # or profile_file = "my-profile.toml" (relative to the plan)
    host = "gpu1"                # optional SSH destination; absent: this machine
    instance_id = "abc123"       # optional; what the profile's meter stop needs
    watch = ["ckpt"]             # optional (default ["ckpt"]); relative: under workdir
    workdir = "/workspace"       # optional
    ssh_options = ["Port=2222"]  # optional; one that runs code (ProxyCommand...) only with --trust-plan
    price_per_hour = 1.2         # optional, for the cost of an idle box

    [[cell]]                     # as in a queue file, plus:
    name = "lr-1"
    box = "gpu1"                 # optional: "any" (the default) spreads it to the box with fewest

Each cell writes under `<watch>/<cell>/` of its box: no two cells may share that path, and names that
differ only in case collide on a case-insensitive disk (a pulled tree on macOS), so they are
refused too. Every problem is one UsageError naming the file, the line where known, and the field.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller import boxes, profiles
from controller.cellsfile import MAX_FILE_BYTES, CellsFile, QueuedCellSpec, Table, cells_of, header_lines
from controller.errors import UsageError
from controller.ssh import argv as sshargv
from controller.tomlfields import read_text

ANY = "any"
MAX_BOXES = 256


@dataclass(frozen=True)
class PlanBox:
    name: str
    profile: str  # a shipped profile's name, or "" with profile_file
    profile_file: str  # absolute; "" with profile
    host: str
    instance_id: str
    watch: tuple[str, ...]
    workdir: str
    ssh_options: tuple[str, ...]
    price_per_hour: float | None
    line: int | None = None
    profile_digest: str = ""  # the profile_file's text as read with the plan (what --trust-plan took)


@dataclass(frozen=True)
class Plan:
    name: str
    boxes: tuple[PlanBox, ...]
    queue: CellsFile  # the cells, in plan order, each with its box as written ("" for any)
    durable: str | None
    roster: tuple[str, ...]

    def assignment(
        self, previous: Mapping[str, str] | None = None, takes_new: Collection[str] | None = None
    ) -> dict[str, list[QueuedCellSpec]]:
        """Box name -> its cells, in plan order, matched by name, never by position: a cell's own
        box; else the box `previous` (cell -> box, as last applied) gave it, if that box is still in
        the plan; else ("any", and new) the box with the fewest cells so far among `takes_new` (default:
        every box; the first such in plan order). The same plan and `previous` always give the same.
        A new cell that no box takes is left out: `unplaced` names it."""
        out: dict[str, list[QueuedCellSpec]] = {b.name: [] for b in self.boxes}
        spread: list[QueuedCellSpec] = []
        for c in self.queue.cells:
            kept = (previous or {}).get(c.name, "")
            if c.box and c.box != ANY:
                out[c.box].append(c)
            elif kept in out:
                out[kept].append(c)
            else:
                spread.append(c)
        open_ = [b.name for b in self.boxes if takes_new is None or b.name in takes_new]
        for c in spread:
            if open_:
                least = min(open_, key=lambda b: len(out[b]))
                out[least].append(c)
        order = {c.name: i for i, c in enumerate(self.queue.cells)}
        return {b: sorted(cells, key=lambda c: order[c.name]) for b, cells in out.items()}

    def unplaced(self, assigned: Mapping[str, Sequence[QueuedCellSpec]]) -> list[str]:
        """The plan's cells that `assigned` gives no box."""
        placed = {c.name for cells in assigned.values() for c in cells}
        return [c.name for c in self.queue.cells if c.name not in placed]


def load_plan(path: Path, *, trusted: bool = False, known_profiles: Collection[str] | None = None) -> Plan:
    text = read_text(path, what="the plan", option="fanout", max_bytes=MAX_FILE_BYTES)
    return parse_plan(
        text,
        file=str(path),
        default_name=path.stem,
        base=path.parent,
        trusted=trusted,
        known_profiles=known_profiles,
    )


def parse_plan(
    text: str,
    *,
    file: str,
    default_name: str,
    base: Path,
    trusted: bool = False,
    known_profiles: Collection[str] | None = None,
) -> Plan:
    """Validate a plan's text. `base`: what a relative profile_file is relative to; `trusted`: the
    user passed --trust-plan (what a plan may not ask unasked is taken: a profile file of its own,
    and the ssh options of controller.ssh.argv.PLAN_REFUSED); `known_profiles`: the shipped
    profiles' names (default: the installed ones)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{file}: not valid TOML: {e}") from e
    top = Table(data, file=file)
    queue = cells_of(top, text, file=file, default_name=default_name, plan=True)
    durable = top.text("durable", required=False, default="") or None
    known = set(profiles.available() if known_profiles is None else known_profiles)
    asks: list[str] = []  # what the plan asks that it may not unasked, each where it is written
    plan_boxes = _boxes(top, text, file, base, known, asks)
    if asks and not trusted:
        raise UsageError(
            "\n".join(asks) + "\na plan file may not ask for that: read the plan (a profile file with "
            "`boxwarden profiles show --profile-file F`), and if you trust what it asks, pass --trust-plan "
            "to `fanout up`"
        )
    names = {b.name for b in plan_boxes}
    folded: dict[str, QueuedCellSpec] = {}
    for c in queue.cells:
        if c.box and c.box != ANY and c.box not in names:
            raise _at(
                file,
                c,
                "box",
                f'{c.box!r} is no [[box]] of this plan; name one of {", ".join(sorted(names))} or "any"',
            )
        other = folded.get(c.name.casefold())
        if other is not None:
            raise _at(
                file,
                c,
                "name",
                f"{c.name!r} and {other.name!r} (line {other.line}) write to the same <watch>/<cell>/ on a "
                "disk that ignores case (a pulled tree on macOS or Windows); rename one",
            )
        folded[c.name.casefold()] = c
    roster = _roster(top, queue)
    top.done()
    return Plan(queue.name, plan_boxes, queue, durable, roster)


def _boxes(
    top: Table, text: str, file: str, base: Path, known: set[str], asks: list[str]
) -> tuple[PlanBox, ...]:
    """The boxes, each checked; what one asks that a plan may not unasked is added to `asks`."""
    rows = top.rows("box")
    if len(rows) > MAX_BOXES:
        raise top.fail("box", f"{len(rows)} boxes; a plan holds at most {MAX_BOXES}")
    lines = header_lines(text, "box", array=True)
    if len(lines) != len(rows):
        lines = []
    out: list[PlanBox] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        line = lines[i] if lines else None
        t = Table(row, file=file, line=line, cell=i + 1, section="box")
        name = t.text("name")
        t.name = name
        try:
            boxes.check_name(name, "box name")
        except UsageError as e:
            raise t.fail("name", str(e)) from None
        if name in seen:
            raise t.fail(
                "name", f"{name!r} is also the name of [[box]] {seen[name] + 1}; give each box its own"
            )
        seen[name] = i
        profile = t.text("profile", required=False, default="")
        profile_file = t.text("profile_file", required=False, default="")
        if bool(profile) == bool(profile_file):
            raise t.fail("profile", "give exactly one of profile (a shipped one) or profile_file")
        if profile and profile not in known:
            raise t.fail("profile", f"{profile!r} is no known profile; known: {', '.join(sorted(known))}")
        digest = ""
        if profile_file:
            path = (base / profile_file).resolve()
            if not path.is_file():
                raise t.fail("profile_file", f"{str(path)!r} is not a file")
            profile_file = str(path)
            digest = profiles.load_file(path).digest
            asks += _profile_file_asks(t, text, path, known)
        watch = t.text_list("watch") or ("ckpt",)
        price = t.number_or_none("price_per_hour")
        if price is not None and (not math.isfinite(price) or price < 0):
            raise t.fail("price_per_hour", f"must be a price of zero or more, not {price}")
        out.append(
            PlanBox(
                name=name,
                profile=profile,
                profile_file=profile_file,
                host=t.text("host", required=False, default=""),
                instance_id=t.text("instance_id", required=False, default=""),
                watch=watch,
                workdir=t.text("workdir", required=False, default=""),
                ssh_options=_ssh_options(t, text, asks),
                price_per_hour=price,
                line=line,
                profile_digest=digest,
            )
        )
        t.done()
    return tuple(out)


def _where(t: Table, text: str, key: str, value: str = "") -> str:
    """`file:line: [[box]] N ('name')` for field `key` of the box's table: the line of its key (with
    `value`: the first line after the key's that holds it), else the table's header line."""
    lines = text.split("\n")
    at = t.line
    start = None
    for n in range(t.line or len(lines), len(lines)):  # t.line: the header's, counted from 1
        if lines[n].lstrip().startswith("["):
            break
        if start is None and lines[n].lstrip().startswith(key):
            start = n
        if start is not None and value.lower() in lines[n].lower():
            at = n + 1
            break
    where = f"{t.file}:{at}" if at else t.file
    return f"{where}: [[box]] {t.cell} ({t.name!r})"


def _profile_file_asks(t: Table, text: str, path: Path, shipped: Collection[str]) -> list[str]:
    """A plan's own profile file is taken only with --trust-plan (one whose text is a shipped
    profile's is that profile): its meter stop and poll run on this machine at `down` (an unattended
    `down --when-safe` too), and its facts decide where the box's copies go and when they may go."""
    mine = profiles.load_file(path)
    if any(profiles.load(name).digest == mine.digest for name in shipped):
        return []
    return [
        f"{_where(t, text, 'profile_file')}: field profile_file: {str(path)!r} is no shipped profile: its "
        "meter stop and poll would run on this machine at `down` (an unattended `down --when-safe` too), "
        "and its facts decide where the box's copies go and when they may be deleted (a shipped one: "
        f"profile = one of {', '.join(sorted(shipped))})"
    ]


def _ssh_options(t: Table, text: str, asks: list[str]) -> tuple[str, ...]:
    """The box's ssh options, each checked where it is written (its line, found by its key in the
    box's `ssh_options`; else the table's header line); one a plan may not ask unasked goes to `asks`."""
    out = []
    for option in t.text_list("ssh_options"):
        where = _where(t, text, "ssh_options", option.partition("=")[0].strip())
        checked, why = sshargv.check_plan_option(option, where)
        if why:
            asks.append(f"{where}: field ssh_options: {why}")
        out.append(checked)
    return tuple(out)


def _roster(top: Table, queue: CellsFile) -> tuple[str, ...]:
    given = top.text_list("roster")
    if not given:
        return tuple(c.name for c in queue.cells)
    cells = {c.name for c in queue.cells}
    for name in given:
        if name not in cells:
            raise top.fail("roster", f"{name!r} is no [[cell]] of this plan; the roster names cells it runs")
    if len(set(given)) != len(given):
        raise top.fail("roster", "names a cell twice")
    return given


def _at(file: str, c: QueuedCellSpec, field: str, problem: str) -> UsageError:
    where = f"{file}:{c.line}" if c.line else file
    return UsageError(f"{where}: [[cell]] {c.name!r}: field {field}: {problem}")


def plan_json(plan: Plan, assigned: Mapping[str, Sequence[QueuedCellSpec]] | None = None) -> dict[str, Any]:
    """What `fanout up` records and compares: the plan as it acts (boxes, each box's cells as
    `assigned`, default: the plan's own assignment with nothing applied before)."""
    cells_of_box = plan.assignment() if assigned is None else assigned
    return {
        "name": plan.name,
        "durable": plan.durable,
        "roster": list(plan.roster),
        "restart": [plan.queue.restart, plan.queue.max_restarts, plan.queue.restart_backoff],
        "boxes": {b.name: box_json(b, cells_of_box.get(b.name, ())) for b in plan.boxes},
    }


def box_json(b: PlanBox, cells: Sequence[QueuedCellSpec]) -> dict[str, Any]:
    return {
        "profile": b.profile or b.profile_file,
        # A profile file's text: an edit of its meter stop is a change of the plan, shown and confirmed.
        **({"profile_digest": b.profile_digest} if b.profile_digest else {}),
        "host": b.host,
        "instance_id": b.instance_id,
        "watch": list(b.watch),
        "workdir": b.workdir,
        "ssh_options": list(b.ssh_options),
        "price_per_hour": b.price_per_hour,
        "cells": [{"name": c.name, "argv": list(c.argv), "cwd": c.cwd, "env": dict(c.env)} for c in cells],
    }
