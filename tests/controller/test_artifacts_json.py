"""`artifacts --json` writes its claims by hand (100,000 of them through MessageToDict took
seconds): the text must be exactly what the generic path writes, for any string the wire can hold."""

from __future__ import annotations

import json

from boxwarden_pb.v1 import sidecar_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.cli.artifacts import _CLAIM_FIELDS, _claims_json, _to_dict

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
)


def test_the_fast_path_knows_every_claim_field() -> None:
    assert tuple(f.name for f in pb.Claim.DESCRIPTOR.fields) == _CLAIM_FIELDS


@settings(max_examples=200, deadline=None)
@given(st.lists(claims, max_size=4))
def test_claims_json_is_what_message_to_dict_and_dumps_write(cs: list[pb.Claim]) -> None:
    expected = json.dumps([_to_dict(c) for c in cs], sort_keys=True)
    assert _claims_json(cs) == expected


def test_odd_strings_are_escaped() -> None:
    c = pb.Claim(path='a"b\\c\nd\x7f\u00e9\U0001f600', push_error="</script>\t", blake3="x")
    text = _claims_json([c])
    assert json.loads(text)[0]["path"] == c.path
    assert text == json.dumps([_to_dict(c)], sort_keys=True)
