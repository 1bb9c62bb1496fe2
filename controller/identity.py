"""Who answers: every answer of a sidecar names it (box name, run id, start nonce; the proto's
IDENTITY_METADATA), and the controller takes an answer only from the sidecar its record names.

The record holds the nonce of the sidecar `up` started or adopted; a record of an older version
holds none, and a client then pins the first nonce it sees: a sidecar that takes over the socket
between two calls is refused all the same (SIDECAR_MISMATCH, exit 3).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.errors import SidecarMismatch
from controller.state import Box, State

KEY = "bw-sidecar-identity"  # the sidecar's sidecar.stamp.KEY (tests/test_parity.py)


@dataclass(frozen=True)
class Expected:
    """What the box's record says of its sidecar."""

    box: str
    run_id: str
    durable: str
    state_dir: str
    host: str = ""
    nonce: str = ""  # "": not recorded; the first answer's is taken
    home: str = ""  # the controller state the record lives in ("": none to read again)

    def where(self) -> str:
        return f"on {self.host}" if self.host else "on this machine"

    def reread(self) -> Expected | None:
        """The record as it is now, if `up` restarted (or adopted) the box's sidecar since, for the
        same run and store, while a long command followed the box; None otherwise. Another run is
        not this client's to follow (`events -f` of run 1 must not take run 2's events as its own),
        and a record that names no nonce never undoes the one this client took first."""
        if not self.home:
            return None
        (box,) = State.peek(Path(self.home), [self.box]) or (None,)
        if box is None or box.status == "down":
            return None
        now = of(box)
        if (
            not now.nonce
            or now.nonce == self.nonce
            or (now.run_id, now.durable) != (self.run_id, self.durable)
        ):
            return None
        return now


def of(box: Box) -> Expected:
    home = str(Path(box.box_dir).parent.parent) if box.box_dir else ""  # box_dir is <home>/boxes/<name>
    return Expected(box.name, box.run_id, box.durable, box.state_dir, box.host, box.sidecar_nonce, home)


@dataclass(frozen=True)
class Stamp:
    """Who an answer says it is."""

    box: str
    run_id: str
    nonce: str

    @classmethod
    def parse(cls, value: str | bytes | None) -> Stamp | None:
        text = value.decode(errors="replace") if isinstance(value, bytes) else value
        parts = (text or "").split(" ")
        return cls(*parts) if len(parts) == 3 else None

    def show(self) -> str:
        return f"box {self.box!r}, run {self.run_id!r}, sidecar start {self.nonce[:8]}"


def refusal(expected: Expected, what: str, said: str, differences: Sequence[str]) -> SidecarMismatch:
    return SidecarMismatch(
        f"{what}: the sidecar that answers {expected.where()} is not the one of {expected.box}'s record "
        f"({'; '.join(differences)}); it answered as {said}. Nothing was taken from it. "
        f"`boxwarden status {expected.box}` shows the record; `boxwarden up {expected.box}` checks the "
        "box again (a sidecar another controller started is taken over only with `up --adopt`)"
    )


def check_stamp(expected: Expected, stamp: Stamp | None, what: str) -> Stamp:
    """The stamp of an answer, if it is the expected sidecar's; else SidecarMismatch."""
    if stamp is None:
        raise refusal(expected, what, "nobody (no identity in its answer)", ["the answer names no sidecar"])
    diff = []
    if stamp.box != expected.box:
        diff.append(f"box name {stamp.box!r}, not {expected.box!r}")
    if stamp.run_id != expected.run_id:
        diff.append(f"run {stamp.run_id!r}, not {expected.run_id!r}")
    if expected.nonce and stamp.nonce != expected.nonce:
        diff.append(
            f"started as {stamp.nonce[:8]}, not as {expected.nonce[:8]} (a sidecar `up` did not start or "
            "adopt from here)"
        )
    if diff:
        raise refusal(expected, what, stamp.show(), diff)
    return stamp


def hello_differences(expected: Expected, hello: pb.HelloResponse) -> list[str]:
    """What a Hello says that the record does not (the stamp's fields are checked with every answer)."""
    diff = []
    if hello.durable_url != expected.durable:
        diff.append(f"durable store {hello.durable_url!r}, not {expected.durable!r}")
    if hello.state_dir != expected.state_dir:
        diff.append(f"state dir {hello.state_dir!r}, not {expected.state_dir!r}")
    return diff


def new_nonce() -> str:
    """A start nonce for a sidecar `up` starts (the sidecar takes 16 to 64 letters and digits)."""
    return secrets.token_hex(16)


def credentials_digest(nonce: str, data: bytes) -> str:
    """HelloResponse.credentials_digest of `data` for the sidecar started as `nonce`."""
    return blake3.blake3(nonce.encode() + b"\0" + data).hexdigest()
