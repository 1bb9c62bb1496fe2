"""The sidecar's implementation of the proto's MANIFEST CANONICAL FORM (the controller has its own)."""

from __future__ import annotations

import json
from collections.abc import Iterable

import blake3

from sidecar.ledger import ClaimRow


def canonical_json(claims: Iterable[ClaimRow]) -> bytes:
    files = sorted(
        ({"blake3": c.blake3, "bytes": c.size, "path": c.path} for c in claims),
        key=lambda f: str(f["path"]).encode("utf-8"),
    )
    return json.dumps({"files": files}, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def manifest_digest(claims: Iterable[ClaimRow]) -> str:
    return blake3.blake3(canonical_json(claims)).hexdigest()
