"""`artifacts --json` writes its claims by hand (100,000 of them through MessageToDict took
seconds): the text must be exactly what the generic path writes, for any string the wire can hold."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from boxwarden_pb.v1 import sidecar_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.cli.artifacts import _CLAIM_FIELDS, _claims_json, _listing_json, _to_dict

INT64 = st.integers(0, 2**63 - 1)
claims = st.builds(
    pb.Claim,
    path=st.text(),
    size=INT64,
    blake3=st.text(),
    sealed_at_unix_ns=INT64,
    seq=INT64,
    durable=st.booleans(),
    durable_at_unix_ns=INT64,
    push_error=st.text(),
    proven_at_unix_ns=INT64,
    proof=st.sampled_from(["", "reread", "server-checksum"]) | st.text(),
    durable_only=st.booleans(),
)


def test_the_fast_path_knows_every_claim_field() -> None:
    assert tuple(f.name for f in pb.Claim.DESCRIPTOR.fields) == _CLAIM_FIELDS


@settings(max_examples=200, deadline=None)
@given(st.lists(claims, max_size=4))
def test_claims_json_is_what_message_to_dict_and_dumps_write(cs: list[pb.Claim]) -> None:
    expected = json.dumps([_to_dict(c) for c in cs], sort_keys=True)
    assert "[" + _claims_json(cs) + "]" == expected


def test_odd_strings_are_escaped() -> None:
    c = pb.Claim(path='a"b\\c\nd\x7f\u00e9\U0001f600', push_error="</script>\t", blake3="x", proof="\u00e9\n")
    text = "[" + _claims_json([c]) + "]"
    assert json.loads(text)[0]["path"] == c.path
    assert text == json.dumps([_to_dict(c)], sort_keys=True)


pendings = st.builds(pb.Pending, path=st.text(), state=st.sampled_from([1, 2, 3, 4]), detail=st.text())


@settings(max_examples=100, deadline=None)
@given(
    stale=st.lists(claims, max_size=3),
    cs=st.lists(claims, max_size=6),
    ps=st.lists(pendings, max_size=4),
    size=st.integers(1, 4),
    restart=st.booleans(),
    excluded=INT64,
    sample=st.lists(st.text(), max_size=3),
)
def test_the_listing_written_page_by_page_is_the_merged_listing_dumped(
    stale: list[pb.Claim],
    cs: list[pb.Claim],
    ps: list[pb.Pending],
    size: int,
    restart: bool,
    excluded: int,
    sample: list[str],
) -> None:
    """Pages as the sidecar sends them (claims first, the totals only from the page with the last
    claim on), after a restart marker that must drop what came before it."""
    merged = pb.ListArtifactsResponse(
        claims=cs,
        pending=ps,
        manifest_digest="d",
        seq=7,
        total_claims=len(cs),
        total_pending=len(ps),
        excluded_files=excluded,
        excluded_sample=sample,
    )
    entries: list[pb.Claim | pb.Pending] = [*cs, *ps]
    pages = []
    for start in range(0, max(len(entries), 1), size):
        part = entries[start : start + size]
        page = pb.ListArtifactsResponse(manifest_digest="d", seq=7, total_claims=len(cs))
        page.claims.extend(e for e in part if isinstance(e, pb.Claim))
        page.pending.extend(e for e in part if isinstance(e, pb.Pending))
        if start + size >= len(cs):
            page.total_pending, page.excluded_files = len(ps), excluded
            page.excluded_sample.extend(sample)
        if start + size < len(entries):
            page.next_page_token = f"t:{start + size}"
        pages.append(page)
    before = [pb.ListArtifactsResponse(claims=stale, next_page_token="x"), None] if restart else []

    async def source() -> AsyncIterator[pb.ListArtifactsResponse | None]:
        for p in [*before, *pages]:
            yield p

    assert asyncio.run(_listing_json(source())) == json.dumps(_to_dict(merged), sort_keys=True)
