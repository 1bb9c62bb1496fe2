"""The ledger's in-memory mirror of the current claims never differs from what the database holds,
and the listing's cached messages and digest follow every change (a stale cache would list a claim
as durable after its copy failed, or keep a digest the evidence no longer matches)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sidecar.identity import FileIdentity
from sidecar.ledger import Counts, Ledger
from sidecar.manifest import manifest_digest
from sidecar.server import _WireClaims, claim_to_pb

PATHS = st.sampled_from(["a.pt", "b/c.pt", "b/d.pt", "é.pt", "z"])


class LedgerMirror(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self._dir = tempfile.TemporaryDirectory()
        self.db = Path(self._dir.name) / "ledger.db"
        self.ledger = Ledger(self.db)
        self.wire = _WireClaims()
        self.ino = 0

    def teardown(self) -> None:
        self.ledger.close()
        self._dir.cleanup()

    def _id_of(self, path: str) -> int | None:
        c = self.ledger.current(path)
        return c.id if c else None

    @rule(path=PATHS, size=st.integers(0, 3))
    def seal(self, path: str, size: int) -> None:
        self.ino += 1
        self.ledger.add_claim(
            path, size, f"{self.ino:064x}", FileIdentity(1, self.ino, size, self.ino, self.ino)
        )

    @rule(path=PATHS)
    def touch(self, path: str) -> None:
        c = self.ledger.current(path)
        if c is not None:
            self.ino += 1
            self.ledger.refresh_identity(c.id, FileIdentity(2, self.ino, c.size, self.ino, self.ino))

    @rule(path=PATHS)
    def durable(self, path: str) -> None:
        cid = self._id_of(path)
        if cid is not None:
            assert self.ledger.mark_durable(cid, "reread")

    @rule(path=PATHS, why=st.sampled_from(["gone", "bad bytes"]))
    def not_durable(self, path: str, why: str) -> None:
        cid = self._id_of(path)
        if cid is not None:
            self.ledger.mark_not_durable(cid, why)

    @rule(path=PATHS, why=st.sampled_from(["ENOSPC", "EIO"]))
    def push_failed(self, path: str, why: str) -> None:
        cid = self._id_of(path)
        if cid is not None:
            self.ledger.mark_push_failed(cid, why)

    @rule(path=PATHS)
    def end(self, path: str) -> None:
        self.ledger.end_claim(path, "deleted", "ARTIFACT_REMOVED")

    @rule(path=PATHS)
    def stale_id_is_refused(self, path: str) -> None:
        cid = self._id_of(path)
        if cid is not None:
            self.seal(path, 1)  # supersedes cid
            assert not self.ledger.mark_durable(cid, "reread")

    @rule(key=st.sampled_from(["file:///x#1", "file:///y#2"]))
    def store(self, key: str) -> None:
        self.ledger.bind_store(key)

    @invariant()
    def mirror_equals_database(self) -> None:
        fresh = Ledger(self.db)
        try:
            assert self.ledger.current_claims() == fresh.current_claims()
            assert self.ledger.counts == fresh.counts
        finally:
            fresh.close()
        claims = self.ledger.current_claims()
        assert [self.ledger.current(c.path) for c in claims] == claims
        expected = Counts()
        for c in claims:
            expected.add(c.size, c.durable, 1)
        assert self.ledger.counts == expected

    @invariant()
    def wire_follows_the_ledger(self) -> None:
        claims = self.ledger.current_claims()
        rows, listed, digest = self.wire.of(self.ledger)
        assert rows == claims
        assert listed == [claim_to_pb(c) for c in claims]
        assert digest == manifest_digest(claims)


LedgerMirror.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestLedgerMirror = LedgerMirror.TestCase


def _ident(n: int) -> FileIdentity:
    return FileIdentity(1, n, 1, n, n)


def test_a_retired_copy_is_the_last_durable_claim_whose_file_left_the_box(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.db")
    try:
        v1 = ledger.add_claim("best.pt", 1, "1" * 64, _ident(1))
        assert ledger.retired_copy("best.pt") is None  # current: nothing retired
        assert ledger.mark_durable(v1.id, "reread")
        v2 = ledger.add_claim("best.pt", 1, "2" * 64, _ident(2))  # a rewrite supersedes it
        assert ledger.retired_copy("best.pt") is None
        assert ledger.mark_durable(v2.id, "reread")
        assert ledger.end_claim("best.pt", "deleted or renamed away on the box", "ARTIFACT_REMOVED")
        kept = ledger.retired_copy("best.pt")
        assert kept is not None and kept.id == v2.id
        v3 = ledger.add_claim("best.pt", 1, "3" * 64, _ident(3))  # a new file took the path
        assert ledger.retired_copy("best.pt") == kept  # until it is kept aside, whatever comes next
        ledger.mark_kept(v2.id, ".boxwarden-attic/retired-2/best.pt")
        assert ledger.retired_copy("best.pt") is None
        assert ledger.mark_durable(v3.id, "reread")
        assert ledger.end_claim("best.pt", "released after verified pull", "ARTIFACT_RELEASED")
        again = ledger.retired_copy("best.pt")
        assert again is not None and again.id == v3.id
        ledger.mark_kept(v3.id, None)
        assert ledger.retired_copy("best.pt") is None
        kinds = [e.kind for e in ledger.events_after(0)]
        assert kinds.count("DURABLE_MOVED_ASIDE") == 1 and kinds.count("DURABLE_MISSING") == 1
    finally:
        ledger.close()
