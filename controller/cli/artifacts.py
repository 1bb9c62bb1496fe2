"""`boxwarden artifacts NAME [--json]`: the sidecar's claims, their durable state and proof kind."""

from __future__ import annotations

import asyncio
import json
import json.encoder
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any

import click
from boxwarden_pb.v1 import sidecar_pb2 as pb
from google.protobuf import json_format
from google.protobuf.message import Message

from controller import lastlist, reach, render
from controller.cli.options import json_flag, open_state, stand_aside


@click.command("artifacts")
@click.argument("name")
@json_flag
def command(name: str, as_json: bool) -> None:
    """List box NAME's claims: path, size, blake3, durable, proof kind, durable-only."""
    state = open_state()
    box = state.get(name)
    keep = lastlist.keeper(state, box)  # the list is kept: evidence for when the box is gone
    stand_aside()
    if not as_json:
        render.artifacts(name, asyncio.run(reach.artifacts(box, keep)))
    elif tuple(f.name for f in pb.Claim.DESCRIPTOR.fields) == _CLAIM_FIELDS:
        render.text_out(asyncio.run(_listing_json(reach.artifact_pages(box, keep))))
    else:
        # A Claim with a field this code does not know (a newer proto) goes the slow, exact way.
        render.json_out(_to_dict(asyncio.run(reach.artifacts(box, keep))), compact=True)


async def _listing_json(pages: AsyncIterable[pb.ListArtifactsResponse | None]) -> str:
    """The document `json.dumps(_to_dict(listing), sort_keys=True)` would write, without building
    100,000 dicts: each page's claims are written as the page arrives (while the sidecar still walks
    the watched dirs for the last page), the rest from the last page's header."""
    claims: list[str] = []
    head = pb.ListArtifactsResponse()
    async for page in pages:
        if page is None:  # the listing started again: what came before belongs to another snapshot
            claims.clear()
            head = pb.ListArtifactsResponse()
            continue
        if page.claims:
            claims.append(_claims_json(page.claims))
        head.pending.extend(page.pending)
        if not page.next_page_token:
            for field in ("manifest_digest", "seq", "total_claims", "total_pending", "excluded_files"):
                setattr(head, field, getattr(page, field))
            head.excluded_sample.extend(page.excluded_sample)
    doc = _to_dict(head)
    del doc["claims"]
    # "claims" sorts first among the response's fields.
    assert all(k > "claims" for k in doc)
    rest = json.dumps(doc, sort_keys=True)
    return '{"claims": [' + ", ".join(claims) + "]" + (", " + rest[1:] if doc else "}")


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
    "proof",
    "durable_only",
)


def _claims_json(claims: Iterable[pb.Claim]) -> str:
    """`json.dumps([_to_dict(c) for c in claims], sort_keys=True)` without its brackets, written
    directly (MessageToDict took 4 s for 100,000 claims, dicts and dumps 1 s): int64 fields are
    text, as in proto3's JSON mapping, and every string goes through json's own escaping."""
    q = _quote
    return ", ".join(
        f'{{"blake3": {q(c.blake3)}, "durable": {"true" if c.durable else "false"}, '
        f'"durable_at_unix_ns": "{c.durable_at_unix_ns}", '
        f'"durable_only": {"true" if c.durable_only else "false"}, "path": {q(c.path)}, '
        f'"proof": {q(c.proof)}, "proven_at_unix_ns": "{c.proven_at_unix_ns}", '
        f'"push_error": {q(c.push_error)}, "sealed_at_unix_ns": "{c.sealed_at_unix_ns}", '
        f'"seq": "{c.seq}", "size": "{c.size}"}}'
        for c in claims
    )


_quote: Callable[[str], str] = json.encoder.encode_basestring_ascii
