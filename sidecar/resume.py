"""Which checkpoint a restarted job resumes from: the newest durable checkpoint of its cell whose
bytes on the box are still exactly the claimed ones and which looks like a checkpoint that loads.

A checkpoint is a file (`cell/step-100.pt`), or a directory when its step names a directory
(`cell/checkpoint-500/` of an HF Trainer: model shards, optimizer, trainer_state.json), found as
retention finds them (`keep.place`). A directory counts only whole: every file in it on the box is a
current claim, durable, still the claimed file, none waiting to be sealed again, and it holds at
least one checkpoint file. Then BOXWARDEN_RESUME_FROM names the directory (what
`Trainer.train(resume_from_checkpoint=...)` takes); for a file, the file.

"Looks like it loads" is checked without loading it (the sidecar runs no trainer code and may have
no torch): the file's identity (size, mtime, ctime, inode) is the one sealed and hashed, and its
first bytes are what its format begins with (a torch.save zip or pickle, a safetensors header that
parses). The trainer still loads it itself, and falls back on its own if it cannot.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

from sidecar.compat import SLOTS
from sidecar.errors import SidecarError
from sidecar.identity import FileIdentity
from sidecar.keep import place
from sidecar.ledger import ClaimRow

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl", ".safetensors")
_ZIP = b"PK\x03\x04"
_PICKLE = b"\x80"
_MAX_SAFETENSORS_HEADER = 100 << 20
_MAX_DIR_FILES = 10_000


@dataclass(frozen=True, **SLOTS)
class Candidate:
    """One checkpoint: a file, or a directory of files (`is_dir`), with every claim under it."""

    artifact: str  # the file's artifact path, or the directory's (no trailing "/")
    path: Path  # where it lies on the box
    is_dir: bool
    files: tuple[tuple[Path, ClaimRow], ...]

    @property
    def sealed_at_ns(self) -> int:
        return max(c.sealed_at_ns for _, c in self.files)


def candidates(
    claims: Iterable[ClaimRow],
    prefixes: tuple[str, ...],
    to_abs: Callable[[str], Path],
    *,
    skip: int = 1,
    unsettled: AbstractSet[str] = frozenset(),
) -> list[Candidate]:
    """The checkpoints under `prefixes` (a cell's directories as artifact paths), newest sealed
    first, each with all its current claims; none with a claim not durable, retired from the box,
    or in `unsettled` (written again, being sealed). Cheap: the ledger's mirror only. `skip`: the
    path components before a checkpoint's (the cell, and the watched dir's name with several)."""
    units: dict[str, tuple[bool, list[ClaimRow]]] = {}
    for c in claims:
        if not prefixes or not c.path.startswith(prefixes):
            continue
        p = place(c.path, skip)
        if p is not None and p.inner:
            unit, is_dir = c.path[: len(c.path) - len(p.inner) - 1], True
        else:
            unit, is_dir = c.path, False
        units.setdefault(unit, (is_dir, []))[1].append(c)
    out = []
    for unit, (is_dir, members) in units.items():
        if any(not c.durable or c.durable_only or c.path in unsettled for c in members):
            continue  # not whole on the box, or not proven durable whole
        try:
            files = tuple((to_abs(c.path), c) for c in members)
            out.append(Candidate(unit, to_abs(unit), is_dir, files))
        except SidecarError:
            continue
    out.sort(key=lambda x: x.sealed_at_ns, reverse=True)
    return out


def newest_loadable(found: Iterable[Candidate]) -> Candidate | None:
    """The first of `found` (newest first) whose files are all still the claimed ones and that looks
    like a checkpoint; None if none. Blocking (it reads the box's files)."""
    for cand in found:
        if _whole(cand):
            return cand
    return None


def _whole(cand: Candidate) -> bool:
    if not cand.is_dir and not cand.path.name.endswith(CHECKPOINT_SUFFIXES):
        return False
    for path, claim in cand.files:
        try:
            if FileIdentity.from_path(path) != claim.identity:
                return False  # written again since it was sealed: not the bytes that were proven
        except (SidecarError, OSError):
            return False
    weights = [p for p, _ in cand.files if p.name.endswith(CHECKPOINT_SUFFIXES)]
    if not weights or not all(_looks_whole(p) for p in weights):
        return False
    return not cand.is_dir or _only_claimed(cand)


def _only_claimed(cand: Candidate) -> bool:
    """The directory holds no file but its claims (a shard still being written, or one left out of
    the claims, would make it a checkpoint that does not load)."""
    claimed = {p for p, _ in cand.files}
    seen = 0
    try:
        for root, _dirs, names in os.walk(cand.path, onerror=_raise):
            for name in names:
                seen += 1
                if seen > _MAX_DIR_FILES or Path(root, name) not in claimed:
                    return False
    except OSError:
        return False
    return seen == len(claimed)


def _raise(e: OSError) -> None:
    raise e  # an entry of the directory that cannot be read: not known to be whole


def _looks_whole(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if path.suffix == ".safetensors":
                if len(head) < 8:
                    return False
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_SAFETENSORS_HEADER:
                    return False
                header = json.loads(f.read(n))
                return isinstance(header, dict)
    except (OSError, ValueError):
        return False
    return head.startswith((_ZIP, _PICKLE))
