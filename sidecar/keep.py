"""Retention rules: which checkpoints keep their box-side copy (pure logic; `retention.py` acts).

Rules (`up --keep`, SidecarConfig.keep): `last=N` (the N highest steps of each series), `every=K`
(steps that are multiples of K), `best=FILE:KEY[:min|max]` (in each series, the checkpoint whose
JSON file FILE has the lowest, or highest, number at KEY; a dotted KEY walks nested objects),
comma-separated; a checkpoint any rule keeps is kept. The newest checkpoint of each series is
always kept, and so is one whose FILE exists but holds no finite number at KEY. No rules: everything
is kept.

A checkpoint is found by its step number: past the roster cell (and, with several watched dirs,
the watched dir's name), the first path component that names a step (`step`, `ckpt`, `checkpoint`,
`epoch`, `iter`, `global_step`, `it` followed by a number, as in `step-100.pt`, `checkpoint-500`,
`epoch=3-step=1000.ckpt`, `global_step1000`) is the checkpoint's; its last such number is the step,
and the path with that number replaced is the series: `cell/step-100.pt` is step 100 of
`cell/step-*.pt`; `cell/checkpoint-500/model-00001-of-00002.safetensors` is step 500 of
`cell/checkpoint-*`; `cell/seed1/step-200.pt` is step 200 of `cell/seed1/step-*.pt`. Other numbers
(a seed, a rank, a date, a shard) are not steps: a claim with no step name (`cell/last.pt`,
`cell/v2/best.pt`, `cell/weights-100.pt`) is never retired (in doubt, kept).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.compat import SLOTS
from sidecar.ledger import ClaimRow

_STEP = re.compile(r"(?i)(?:global_step|checkpoint|ckpt|step|epoch|iter|it)[-_=]?(\d+)")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_METRICS = 1 << 20


@dataclass(frozen=True, **SLOTS)
class KeepRules:
    last: int = 0
    every: int = 0
    best_file: str = ""
    best_key: str = ""
    best_max: bool = False
    text: str = ""

    @property
    def active(self) -> bool:
        return bool(self.last or self.every or self.best_file)


NO_RULES = KeepRules()


def parse_keep(text: str) -> KeepRules:
    """`last=3,every=10,best=metrics.json:loss` → KeepRules; ValueError saying what is wrong."""
    last = every = 0
    best_file = best_key = ""
    best_max = False
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not value:
            raise ValueError(f"{item!r}: expected NAME=VALUE (last=3, every=10, best=metrics.json:loss)")
        if name in ("last", "every"):
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{item!r}: {name} takes a whole number of at least 1")
            last, every = (int(value), every) if name == "last" else (last, int(value))
        elif name == "best":
            parts = value.split(":")
            if len(parts) == 3 and parts[2] in ("min", "max"):
                best_max = parts.pop() == "max"
            if len(parts) != 2 or not _NAME.match(parts[0]) or not parts[1]:
                raise ValueError(f"{item!r}: best takes FILE:KEY[:min|max], FILE a plain file name")
            best_file, best_key = parts
        else:
            raise ValueError(f"{item!r}: unknown rule {name!r}; known: last, every, best")
    return KeepRules(last, every, best_file, best_key, best_max, text.strip())


@dataclass(frozen=True, **SLOTS)
class _Place:
    series: str
    step: int
    inner: str  # the path below the checkpoint's own component ("" for a one-file checkpoint)


def place(path: str, skip: int) -> _Place | None:
    """Where a claim sits among the checkpoints (None: it is not part of one)."""
    parts = path.split("/")
    head = min(skip, len(parts) - 1)  # a file right in the watched dir has no cell
    for i in range(head, len(parts)):
        runs = list(_STEP.finditer(parts[i]))
        if runs:
            last = runs[-1]
            pattern = parts[i][: last.start(1)] + "*" + parts[i][last.end(1) :]
            return _Place("/".join([*parts[:i], pattern]), int(last.group(1)), "/".join(parts[i + 1 :]))
    return None


def choose(
    claims: list[ClaimRow], rules: KeepRules, skip: int, metric: Callable[[ClaimRow], float | None]
) -> list[ClaimRow]:
    """The claims whose box-side copy the rules let go: durable, not durable-only already, in a
    checkpoint no rule keeps. `metric(claim)` reads a best= file (None: none, unreadable or not a
    finite number)."""
    if not rules.active:
        return []
    series: dict[str, dict[int, list[ClaimRow]]] = {}
    for c in claims:
        p = place(c.path, skip)
        if p is not None:
            series.setdefault(p.series, {}).setdefault(p.step, []).append(c)
    out: list[ClaimRow] = []
    for steps in series.values():
        ordered = sorted(steps, reverse=True)
        keep = set(ordered[: max(1, rules.last)])
        if rules.every:
            keep.update(s for s in ordered if s % rules.every == 0)
        if rules.best_file:
            keep.update(_best(steps, rules, metric))
        for step in ordered:
            if step not in keep:
                out += [c for c in steps[step] if c.durable and not c.durable_only]
    return out


def _best(
    steps: dict[int, list[ClaimRow]], rules: KeepRules, metric: Callable[[ClaimRow], float | None]
) -> set[int]:
    """The step whose metrics file is best, plus every step whose metrics file exists and cannot be
    read as a number (in doubt, kept)."""
    scored: list[tuple[float, int]] = []
    doubtful: set[int] = set()
    for step, group in steps.items():
        files = [c for c in group if c.path.rsplit("/", 1)[-1] == rules.best_file]
        for f in files:
            if f.durable_only:
                continue  # retired already: it was not the best when it was
            value = metric(f)
            if value is None:
                doubtful.add(step)
            else:
                scored.append((-value if rules.best_max else value, step))
    if scored:
        doubtful.add(min(scored)[1])
    return doubtful


def read_metric(data: bytes, key: str) -> float | None:
    """The number at the dotted `key` of a JSON document; None if there is none, or it is not finite."""
    try:
        value: object = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    for name in key.split("."):
        if not isinstance(value, dict) or name not in value:
            return None
        value = value[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
