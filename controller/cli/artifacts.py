"""`boxwarden artifacts NAME [--json]`: the sidecar's claims and their durable state."""

from __future__ import annotations

import asyncio
from typing import Any

import click
from boxwarden_pb.v1 import sidecar_pb2 as pb
from google.protobuf import json_format
from google.protobuf.message import Message

from controller import boxes, render
from controller.cli.options import json_flag, open_state


@click.command("artifacts")
@click.argument("name")
@json_flag
def command(name: str, as_json: bool) -> None:
    """List box NAME's claims: path, size, blake3, durable."""
    listing = asyncio.run(boxes.artifacts(open_state().get(name)))
    if as_json:
        # A Claim with a field this code does not know (a newer proto) goes the slow, exact way.
        fast = tuple(f.name for f in pb.Claim.DESCRIPTOR.fields) == _CLAIM_FIELDS
        claims = [_claim_dict(c) for c in listing.claims] if fast else None
        if fast:
            del listing.claims[:]
        doc = _to_dict(listing)
        if claims is not None:
            doc["claims"] = claims
        render.json_out(doc, compact=True)
    else:
        render.artifacts(name, listing)


def _to_dict(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


_CLAIM_FIELDS = (
    "path",
    "size",
    "blake3",
    "sealed_at_unix_ns",
    "seq",
    "durable",
    "durable_at_unix_ns",
    "push_error",
    "proven_at_unix_ns",
)


def _claim_dict(c: pb.Claim) -> dict[str, Any]:
    """`_to_dict(c)`, about 10× faster (MessageToDict took 4 s for 100,000 claims): int64 fields
    are text, as in proto3's JSON mapping."""
    return {
        "path": c.path,
        "size": str(c.size),
        "blake3": c.blake3,
        "sealed_at_unix_ns": str(c.sealed_at_unix_ns),
        "seq": str(c.seq),
        "durable": c.durable,
        "durable_at_unix_ns": str(c.durable_at_unix_ns),
        "push_error": c.push_error,
        "proven_at_unix_ns": str(c.proven_at_unix_ns),
    }
