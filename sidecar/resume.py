"""Which checkpoint a restarted job resumes from: the newest durable claim of its cell whose file on
the box is still exactly the claimed one and looks like a checkpoint that loads.

"Looks like it loads" is checked without loading it (the sidecar runs no trainer code and may have
no torch): the file's identity (size, mtime, ctime, inode) is the one sealed and hashed, and its
first bytes are what its format begins with (a torch.save zip or pickle, a safetensors header that
parses). The trainer still loads it itself, and falls back on its own if it cannot.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from sidecar.errors import SidecarError
from sidecar.identity import FileIdentity
from sidecar.ledger import ClaimRow

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl", ".safetensors")
_ZIP = b"PK\x03\x04"
_PICKLE = b"\x80"
_MAX_SAFETENSORS_HEADER = 100 << 20


def candidates(
    claims: Iterable[ClaimRow], prefixes: tuple[str, ...], to_abs: Callable[[str], Path]
) -> list[tuple[Path, ClaimRow]]:
    """The durable claims under `prefixes` (a cell's directories as artifact paths; () for every
    claim), newest sealed first, with their paths on the box. Cheap: the ledger's mirror only."""
    found = [c for c in claims if c.durable and not c.durable_only and c.path.startswith(prefixes or ("",))]
    found.sort(key=lambda c: c.sealed_at_ns, reverse=True)
    out = []
    for c in found:
        try:
            out.append((to_abs(c.path), c))
        except SidecarError:
            continue
    return out


def newest_loadable(found: Iterable[tuple[Path, ClaimRow]]) -> str:
    """The first of `found` (newest first) that is durable, still the claimed file, and looks like
    a checkpoint (CHECKPOINT_SUFFIXES, and its format's first bytes); "" if none. Blocking."""
    for path, claim in found:
        if not claim.durable or not path.name.endswith(CHECKPOINT_SUFFIXES):
            continue
        try:
            if FileIdentity.from_path(path) != claim.identity:
                continue  # written again since it was sealed: not the bytes that were proven
        except (SidecarError, OSError):
            continue
        if _looks_whole(path):
            return str(path)
    return ""


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
