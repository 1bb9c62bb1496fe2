"""Fast table tests of the pure parts of the gate and of the sidecar's error translation: no
sidecar, no CLI, no torch."""

from __future__ import annotations

import errno
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.errors import Reason, SidecarRefused, SidecarUnreachable, VersionMismatch
from controller.gate import Evidence, evidence_document, judge, sidecar_reason
from controller.lastlist import GoneBox
from controller.verify import VerifyReport
from sidecar.errors import ChangedError, NotFoundError, PreconditionError, StorageError, UnsafePathError
from sidecar.rpcerrors import status_of

DIGEST = "a" * 64


def clean() -> Evidence:
    claim = pb.Claim(path="cell-a/best.pt", size=3, blake3="b" * 64, durable=True, proven_at_unix_ns=1)
    report = VerifyReport(Path("/p"), True, (), 1, 3, DIGEST, "r", (), None)
    return Evidence(
        box="b1",
        pulled_dir="/p",
        claims=[claim],
        box_manifest_digest=DIGEST,
        verify=report,
        marker_digest=DIGEST,
    )


def with_(ev: Evidence, **changes: object) -> Evidence:
    return replace(ev, **changes)  # type: ignore[arg-type]


CASES: list[tuple[str, Evidence, list[Reason], set[str]]] = [
    ("clean", clean(), [], set()),
    ("stale marker", with_(clean(), marker_digest="c" * 64), [], {"MANIFEST_STALE"}),
    ("no marker", with_(clean(), marker_digest=""), [], {"NOT_VERIFIED"}),
    ("job running", with_(clean(), jobs=[pb.Job(id="j1", pid=5, live_pids=[5, 6])]), [], {"JOB_RUNNING"}),
    (  # issue 25, finding 5: a process outside every job is named, and never called a job
        "stray process",
        with_(clean(), strays=[pb.Stray(pid=7, command="tail -f log", cwd="/w", why="works in /w")]),
        [],
        {"STRAY_PROCESS"},
    ),
    (
        "not durable",
        with_(
            clean(), claims=[pb.Claim(path="x", size=1, blake3="b" * 64, durable=False, push_error="full")]
        ),
        [],
        {"NOT_DURABLE"},
    ),
    (
        "pending of every kind",
        with_(
            clean(),
            pending=[
                pb.Pending(path="w", state=pb.PENDING_WRITING),
                pb.Pending(path="c", state=pb.PENDING_CHANGED),
                pb.Pending(path="t.tmp", state=pb.PENDING_TEMP),
                pb.Pending(path="l", state=pb.PENDING_UNCLAIMABLE, detail="a symlink"),
            ],
        ),
        [],
        {"UNSEALED_WRITES", "TEMP_FILE", "UNCLAIMABLE"},
    ),
    (
        "unreachable",
        Evidence(box="b1", pulled_dir="/p"),
        [Reason("SIDECAR_UNREACHABLE")],
        {"SIDECAR_UNREACHABLE"},
    ),
]


@pytest.mark.parametrize(("ev", "early", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_judge_refuses_exactly_for_its_reasons(ev: Evidence, early: list[Reason], expected: set[str]) -> None:
    dry = judge(ev, list(early), confirm=None, dry_run=True)
    assert {r.code for r in dry.reasons} == expected
    assert dry.allowed is (not expected)
    real = judge(ev, list(early), confirm=None, dry_run=False)
    assert {r.code for r in real.reasons} == expected | {"NOT_CONFIRMED"}
    assert judge(ev, list(early), confirm="b1", dry_run=False).allowed is (not expected)


def test_the_evidence_digest_follows_the_evidence_not_the_clock() -> None:
    a = judge(clean(), [], confirm=None, dry_run=True)
    b = judge(clean(), [], confirm=None, dry_run=True)
    assert a.evidence_digest == b.evidence_digest
    other = judge(with_(clean(), excluded_files=3), [], confirm=None, dry_run=True)
    assert other.evidence_digest != a.evidence_digest


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (SidecarUnreachable("x"), "SIDECAR_UNREACHABLE"),
        (VersionMismatch("x"), "VERSION_MISMATCH"),
        (SidecarRefused("x", "FAILED_PRECONDITION"), "SIDECAR_REFUSED"),
    ],
)
def test_a_failure_to_ask_the_sidecar_is_named_for_what_it_was(err: Exception, code: str) -> None:
    assert sidecar_reason(err).code == code  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("err", "code"),
    [
        (UnsafePathError("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotFoundError("x"), grpc.StatusCode.NOT_FOUND),
        (PreconditionError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (ChangedError("x"), grpc.StatusCode.ABORTED),
        (StorageError("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (FileNotFoundError(errno.ENOENT, "gone", "/f"), grpc.StatusCode.NOT_FOUND),
        (PermissionError(errno.EACCES, "denied", "/f"), grpc.StatusCode.PERMISSION_DENIED),
        (OSError(errno.ENOSPC, "full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (OSError(errno.EIO, "io"), grpc.StatusCode.FAILED_PRECONDITION),
        (KeyError("bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_every_error_leaves_the_sidecar_as_a_specific_status(err: Exception, code: grpc.StatusCode) -> None:
    got, message = status_of(err)
    assert got == code
    assert got != grpc.StatusCode.UNAVAILABLE  # the controller reads that as "did not answer"
    assert message


def durable_claims(*proofs: str) -> list[pb.Claim]:
    return [
        pb.Claim(path=f"cell-a/{i}.pt", size=3, blake3="b" * 64, durable=True, proven_at_unix_ns=1, proof=p)
        for i, p in enumerate(proofs)
    ]


PROOF_CASES: list[tuple[str, tuple[str, ...], bool, set[str]]] = [
    ("an older sidecar's empty proof is a re-read", ("", "reread"), False, set()),
    ("server-checksum refused", ("reread", "server-checksum"), False, {"WEAK_PROOF"}),
    ("server-checksum accepted", ("reread", "server-checksum"), True, set()),
    ("an unknown kind is never taken", ("crc-only",), True, {"WEAK_PROOF"}),
]


@pytest.mark.parametrize(
    ("proofs", "accepted", "expected"), [c[1:] for c in PROOF_CASES], ids=[c[0] for c in PROOF_CASES]
)
def test_the_gate_takes_a_server_checksum_only_when_the_user_accepted_it(
    proofs: tuple[str, ...], accepted: bool, expected: set[str]
) -> None:
    ev = with_(clean(), claims=durable_claims(*proofs), accepted_server_checksum=accepted)
    v = judge(ev, [], confirm="b1", dry_run=False)
    assert {r.code for r in v.reasons} == expected and v.allowed is (not expected)
    weak = {
        c.path for c in ev.claims if c.proof == "crc-only" or (c.proof == "server-checksum" and not accepted)
    }
    assert {r.path for r in v.reasons} == weak
    row = next(c for c in v.checks if c.name == "durable proofs")
    assert row.ok is (not expected)
    doc = v.to_json()
    assert doc["accepted_server_checksum"] is accepted and doc["box_gone"] is None
    assert sum(doc["proofs"].values()) == len(proofs)  # type: ignore[attr-defined]


def test_accepting_a_server_checksum_is_part_of_the_evidence() -> None:
    ev = with_(clean(), claims=durable_claims("server-checksum"))
    refused = judge(ev, [], confirm=None, dry_run=True)
    accepted = judge(with_(ev, accepted_server_checksum=True), [], confirm=None, dry_run=True)
    assert refused.proofs == accepted.proofs == {"server-checksum": 1}
    assert "accepted by you" in next(c.detail for c in accepted.checks if c.name == "durable proofs")
    assert accepted.evidence_digest != refused.evidence_digest
    doc = evidence_document(with_(ev, accepted_server_checksum=True), [])
    assert doc["accepted_server_checksum"] is True
    assert doc["claims"] == [["cell-a/0.pt", 3, "b" * 64, True, 1, "server-checksum", False]]


def gone_box(pulled: str = "/p", problem: str = "") -> GoneBox:
    return GoneBox(
        unreachable="Hello: the sidecar did not answer",
        list_received_at_ns=1_700_000_000 * 10**9,
        durable_root="file:///store/b1/r1",
        durable_pull=pulled,
        durable_pull_problem=problem,
        absence="the provider says it is gone (`show i-1` exit 1: not found)",
    )


def test_a_gone_box_is_judged_on_its_last_list_and_a_pull_of_it_from_durable() -> None:
    ev = with_(clean(), claims=durable_claims("reread", "server-checksum"), gone=gone_box())
    v = judge(ev, [], confirm="b1", dry_run=False)
    # The copies were read and hashed here: the sidecar's weaker proof does not hold the gate.
    assert v.allowed, v.reasons
    names = [c.name for c in v.checks]
    assert names[0] == "box gone (--box-gone)" and "pulled from durable storage" in names
    assert "no job running" not in names  # the box's live state is not judged, and says so
    assert v.gone is not None
    judged = v.to_json()["box_gone"]["judged"]  # type: ignore[index]
    at = "2023-11-14T22:13:20Z"
    assert judged == f"durable bytes from the last claims list received at {at} (not the box's live state)"
    assert evidence_document(ev, [])["box_gone"] == v.gone.to_json()
    assert judge(with_(ev, gone=None), [], confirm="b1", dry_run=False).evidence_digest != v.evidence_digest


def test_a_gone_box_that_nothing_proves_gone_and_its_lost_entries_are_refused() -> None:
    """Issue 25, finding 3: the user's word and a silent sidecar do not prove a box gone; what its
    last list could not cover is never shown `ok`."""
    up = replace(
        gone_box(),
        absence="",
        presence="sidecar dead, host up: h answers over SSH",
        presence_code="SIDECAR_DEAD_HOST_UP",
    )
    ev = with_(clean(), claims=durable_claims("reread"), gone=up)
    v = judge(ev, [], confirm="b1", dry_run=False)
    assert [r.code for r in v.reasons] == ["SIDECAR_DEAD_HOST_UP"] and "host up" in v.reasons[0].detail
    assert not next(c for c in v.checks if c.name == "box gone (--box-gone)").ok
    v = judge(with_(ev, gone=replace(gone_box(), absence="")), [], confirm="b1", dry_run=False)
    assert [r.code for r in v.reasons] == ["GONE_UNPROVEN"]  # no word of why: still not gone
    lost = pb.Pending(path="cell-a/link", state=pb.PENDING_UNCLAIMABLE, detail="a symlink")
    ev = with_(clean(), claims=durable_claims("reread"), gone=replace(gone_box(), pending=1))
    ev.pending = [lost]
    v = judge(ev, [], confirm="b1", dry_run=False)
    assert [(r.code, r.path) for r in v.reasons] == [("LOST_WITH_BOX", "cell-a/link")]
    assert not next(c for c in v.checks if c.name == "the box's live state").ok
    accepted = judge(with_(ev, accepted_lost=True), [], confirm="b1", dry_run=False)
    assert accepted.allowed
    assert (
        "(accepted: --accept-lost)"
        in next(c for c in accepted.checks if c.name == "the box's live state").detail
    )
    assert accepted.evidence_digest != v.evidence_digest


@pytest.mark.parametrize(
    ("ev", "expected"),
    [
        (
            with_(clean(), gone=gone_box("", "no pull from durable storage of b1 placed every claim yet")),
            {"NOT_PULLED"},
        ),
        (
            with_(
                clean(), gone=gone_box(), claims=[pb.Claim(path="x", size=1, blake3="b" * 64, durable=False)]
            ),
            {"NOT_DURABLE"},
        ),
        (with_(clean(), gone=gone_box(), marker_digest="c" * 64), {"MANIFEST_STALE"}),
    ],
    ids=["not pulled from durable", "not durable in the last list", "verified against another list"],
)
def test_a_gone_box_stays_refused_without_its_evidence_complete(ev: Evidence, expected: set[str]) -> None:
    v = judge(ev, [], confirm="b1", dry_run=False)
    assert {r.code for r in v.reasons} == expected and not v.allowed
