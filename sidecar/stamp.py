"""Every answer names who gives it: the sidecar's box name, run id and start nonce go out as the
initial metadata of every call (IDENTITY_METADATA in the proto), refusals included, so that a
controller never takes another box's sidecar for its own, even one that took over the socket
between two calls.

The nonce is new at each start: the one `up` chose (`--nonce`), else one made here. No grpc here:
the config reads it before grpc may load (sidecar.rpcstamp sends it).
"""

from __future__ import annotations

import re
import secrets

import blake3

KEY = "bw-sidecar-identity"
NONCE_RE = re.compile(r"^[A-Za-z0-9]{16,64}$")


def new_nonce() -> str:
    return secrets.token_hex(16)


def value(box_name: str, run_id: str, nonce: str) -> str:
    return f"{box_name} {run_id} {nonce}"


def credentials_digest(nonce: str, data: bytes | None) -> str:
    """Which credentials were read, without showing them (HelloResponse.credentials_digest)."""
    if data is None:
        return ""
    return blake3.blake3(nonce.encode() + b"\0" + data).hexdigest()
