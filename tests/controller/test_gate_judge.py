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
from controller.gate import Evidence, judge, sidecar_reason
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
