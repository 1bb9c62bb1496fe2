"""What the durable evidence says: how each claim's durable copy was proven, which proofs the gate
takes, and the durable line of the evidence.

A sidecar proves a copy in one of two ways (Claim.proof): "reread", the copy read back whole and
hashed equal to the claim (every file:// copy, and S3 by default), or "server-checksum", the
store's full-object checksum equal to the one computed while uploading (S3 with
`?proof=server-checksum`: cheaper egress, weaker: nothing was read back). The gate takes a re-read;
a server checksum only when the user accepted it (`down --accept-server-checksum`); a proof of a
kind this controller does not know, never. An empty proof on a durable claim is a re-read: sidecars
from before Claim.proof existed proved copies only that way.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.errors import Reason

REREAD, SERVER_CHECKSUM = "reread", "server-checksum"
_SAID = {REREAD: "re-read from the device and hashed equal", SERVER_CHECKSUM: "by the store's checksum only"}


def proof_kind(c: pb.Claim) -> str:
    """How a claim's durable copy was proven ("" when it is not durable)."""
    if not c.durable:
        return ""
    return c.proof or REREAD


def counts(claims: Sequence[pb.Claim]) -> dict[str, int]:
    """Durable claims by proof kind."""
    return dict(sorted(Counter(proof_kind(c) for c in claims if c.durable).items()))


def weak(claims: Sequence[pb.Claim], *, accepted: bool) -> list[Reason]:
    """WEAK_PROOF for each durable claim whose proof the gate does not take."""
    out = []
    for c in claims:
        kind = proof_kind(c)
        if kind in ("", REREAD) or (kind == SERVER_CHECKSUM and accepted):
            continue
        if kind == SERVER_CHECKSUM:
            detail = (
                "its durable copy was proven by the store's checksum only (server-checksum), never read "
                "back: accept that proof with `down --accept-server-checksum`, or let the sidecar re-read "
                "copies (a durable URL without ?proof=server-checksum)"
            )
        else:
            detail = f"its durable copy's proof {kind!r} is of a kind this controller does not know"
        out.append(Reason("WEAK_PROOF", path=c.path, detail=detail))
    return out


def check_detail(claims: Sequence[pb.Claim], *, accepted: bool, gone: bool = False) -> str:
    """The proof kinds row of the evidence (`gone`: the copies of a gone box, read back here)."""
    kinds = counts(claims)
    if not kinds:
        return "no durable copy"
    line = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    if gone:
        return (
            f"{line}, by the sidecar; every copy is read back and hashed here (the pull, and again at down)"
        )
    if kinds.get(SERVER_CHECKSUM):
        line += (
            "; server-checksum accepted by you (--accept-server-checksum)"
            if accepted
            else "; server-checksum is taken only with --accept-server-checksum"
        )
    return line


def durable_detail(claims: Sequence[pb.Claim], waiting: int, *, gone: bool) -> str:
    """The durable line: how many claims are durable, how each was proven, and when."""
    head = f"{len(claims) - waiting}/{len(claims)} durable"
    kinds = counts(claims)
    if not kinds:
        return head
    how = ", ".join(f"{n} {_SAID.get(kind, f'by {kind!r}')}" for kind, n in kinds.items())
    if gone:
        return (
            f"{head} in the last claims list ({how}); `down --box-gone` reads every copy back here and "
            "hashes it again before the meter stop"
        )
    proofs = [c.proven_at_unix_ns or c.durable_at_unix_ns for c in claims if c.durable]
    oldest = min(proofs)
    age = max(0, time.time_ns() - oldest) // 1_000_000_000
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(oldest / 1e9))
    return (
        f"{head} ({how}), the oldest proof at {when} ({age}s ago); `down` proves every copy again "
        "before it deletes anything"
    )
