"""Retention by value: the rules (pure), and a real sidecar retiring box-side copies only after
their durable copy re-read equal, serving retired claims from the durable store."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.identity import FileIdentity
from sidecar.keep import choose, parse_keep, place, read_metric
from sidecar.ledger import ClaimRow, Ledger
from sidecar.retention import Retainer
from sidecar.storage import open_store
from sidecar.storage.local import LocalStore
from tests.conftest import wait_until
from tests.sidecar.conftest import make_sealer
from tests.sidecar.daemon import running


def claim(path: str, *, durable: bool = True, durable_only: bool = False, seq: int = 1) -> ClaimRow:
    return ClaimRow(
        id=seq,
        path=path,
        size=1,
        blake3="0" * 64,
        identity=FileIdentity(1, seq, 1, 0, 0),
        sealed_at_ns=seq,
        seq=seq,
        durable=durable,
        durable_at_ns=seq if durable else 0,
        push_error="",
        proof="reread" if durable else "",
        durable_only=durable_only,
    )


def test_rules_parse_and_refuse_what_they_cannot_mean() -> None:
    r = parse_keep("last=3, best=metrics.json:eval.loss, every=10")
    assert (r.last, r.every, r.best_file, r.best_key, r.best_max) == (
        3,
        10,
        "metrics.json",
        "eval.loss",
        False,
    )
    assert parse_keep("best=m.json:acc:max").best_max and not parse_keep("").active
    for bad, why in (
        ("last=0", "at least 1"),
        ("last=x", "whole number"),
        ("keep=3", "unknown rule"),
        ("best=metrics.json", "FILE:KEY"),
        ("best=../m.json:loss", "FILE:KEY"),
        ("last", "NAME=VALUE"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_keep(bad)


def test_checkpoints_are_found_by_their_step_past_the_cell() -> None:
    assert place("cell-3/step-100.pt", 1) == place("cell-3/step-100.pt", 1)
    p = place("cell-3/step-100.pt", 1)
    assert p is not None and (p.series, p.step) == ("cell-3/step-*.pt", 100)
    p = place("run2/ckpt-7/model.safetensors", 1)
    assert p is not None and (p.series, p.step, p.inner) == ("run2/ckpt-*", 7, "model.safetensors")
    p = place("ckpt-5.pt", 1)  # right in the watched dir: no cell
    assert p is not None and (p.series, p.step) == ("ckpt-*.pt", 5)
    p = place("c/checkpoint-500/model-00001-of-00002.safetensors", 1)  # HF Trainer: shards are no steps
    assert p is not None and (p.series, p.step) == ("c/checkpoint-*", 500)
    p = place("c/seed1/step-200.pt", 1)  # a seed is no step
    assert p is not None and (p.series, p.step) == ("c/seed1/step-*.pt", 200)
    p = place("c/epoch=3-step=1000.ckpt", 1)  # Lightning: the last step-like number
    assert p is not None and (p.series, p.step) == ("c/epoch=3-step=*.ckpt", 1000)
    for never in ("cell-3/last.pt", "c/v2/best.pt", "c/2024-06-01/ckpt.pt", "c/rank0/weights-100.pt"):
        assert place(never, 1) is None, never  # no step name: never retired


def test_choose_keeps_the_newest_the_multiples_the_best_and_the_doubtful() -> None:
    claims = [claim(f"c/step-{s}.pt", seq=s) for s in (1, 2, 3, 10, 11, 12)] + [claim("c/last.pt", seq=99)]
    names = lambda cs: sorted(c.path for c in cs)  # noqa: E731
    assert names(choose(claims, parse_keep("last=2"), 1, lambda c: None)) == [
        "c/step-1.pt",
        "c/step-10.pt",
        "c/step-2.pt",
        "c/step-3.pt",
    ]
    assert names(choose(claims, parse_keep("last=1,every=10"), 1, lambda c: None)) == [
        "c/step-1.pt",
        "c/step-11.pt",
        "c/step-2.pt",
        "c/step-3.pt",
    ]
    # every= alone still keeps the newest: a rule never leaves a series without its last save.
    assert "c/step-12.pt" not in names(choose(claims, parse_keep("every=5"), 1, lambda c: None))
    # Not durable yet, or retired already: not chosen.
    few = [claim("c/step-1.pt", durable=False, seq=1), claim("c/step-2.pt", durable_only=True, seq=2)]
    few.append(claim("c/step-3.pt", seq=3))
    assert choose(few, parse_keep("last=1"), 1, lambda c: None) == []
    # best=: the lowest loss is kept, and a metrics file that cannot be read keeps its checkpoint.
    dirs = []
    for s in range(1, 6):
        dirs += [claim(f"c/ckpt-{s}/model.pt", seq=10 * s), claim(f"c/ckpt-{s}/metrics.json", seq=10 * s + 1)]
    losses = {f"c/ckpt-{s}/metrics.json": v for s, v in ((1, 0.5), (2, 0.1), (3, None), (4, 0.9), (5, 0.7))}
    kept_out = names(
        choose(dirs, parse_keep("last=1,best=metrics.json:loss"), 1, lambda c: losses.get(c.path))
    )
    assert kept_out == [
        "c/ckpt-1/metrics.json",
        "c/ckpt-1/model.pt",
        "c/ckpt-4/metrics.json",
        "c/ckpt-4/model.pt",
    ]
    assert read_metric(b'{"eval": {"loss": 0.25}}', "eval.loss") == 0.25
    for bad in (b'{"loss": NaN}', b'{"loss": "0.1"}', b'{"loss": true}', b"not json", b'{"x": 1}'):
        assert read_metric(bad, "loss") is None


class FailsItsProof(LocalStore):
    """A file:// store whose copies never prove equal (bit rot, a tampered bucket)."""

    def verify(self, rel: str, digest: str, *, reread: bool = False) -> str | None:
        return None


def test_retention_never_deletes_a_box_copy_whose_durable_copy_does_not_prove(tmp_path: Path) -> None:
    asyncio.run(_never_deletes_unproven(tmp_path))


async def _never_deletes_unproven(tmp_path: Path) -> None:
    watch, durable = tmp_path / "watch", tmp_path / "durable"
    (watch / "c").mkdir(parents=True)
    durable.mkdir()
    real = open_store(durable.as_uri(), ("box", "run"))
    ledger = Ledger(tmp_path / "ledger.sqlite")
    for step in (1, 2, 3):
        f = watch / "c" / f"step-{step}.pt"
        f.write_bytes(os.urandom(1000 + step))
        staged = real.stage(f, f"c/step-{step}.pt")
        real.commit(staged)
        c = ledger.add_claim(f"c/step-{step}.pt", staged.size, staged.digest, FileIdentity.of(f.stat()))
        assert ledger.mark_durable(c.id, "reread")
    failing = FailsItsProof(real.root, url=real.url)
    with ThreadPoolExecutor(2) as pool:
        for store, expect_retired in ((failing, 0), (real, 2)):
            sealer = make_sealer(watch, ledger, store, pool, settle_s=0.05)
            retired = await Retainer(sealer, parse_keep("last=1")).once()
            assert retired == expect_retired
            if store is failing:
                # Every box copy stays; the claims whose copies did not prove are not durable any more.
                assert sorted(p.name for p in (watch / "c").iterdir()) == [
                    "step-1.pt",
                    "step-2.pt",
                    "step-3.pt",
                ]
                assert [c.durable for c in ledger.current_claims()] == [False, False, True]
                for c in ledger.current_claims():  # pushed again (as the sealer would) and proven
                    ledger.mark_durable(c.id, "reread")
    assert sorted(p.name for p in (watch / "c").iterdir()) == ["step-3.pt"]
    assert [(c.path, c.durable_only) for c in ledger.current_claims()] == [
        ("c/step-1.pt", True),
        ("c/step-2.pt", True),
        ("c/step-3.pt", False),
    ]
    ledger.close()
    real.close()


def test_a_sidecar_retires_old_checkpoints_and_serves_them_from_durable(tmp_path: Path) -> None:
    with running(tmp_path, keep="last=2") as d:
        digests = {}
        for step in range(1, 5):
            data = os.urandom(50_000 + step)
            (d.watch / "cell-a").mkdir(exist_ok=True)
            (d.watch / "cell-a" / f"step-{step}.pt").write_bytes(data)
            digests[f"cell-a/step-{step}.pt"] = blake3.blake3(data).hexdigest()
        (d.watch / "cell-a" / "last.pt").write_bytes(b"latest")
        d.wait_durable(5)

        def retired() -> list[pb.Claim] | None:
            cs = [c for c in d.claims() if c.durable_only]
            return cs if len(cs) == 2 else None

        gone = wait_until(retired, timeout=30, what="two retired claims")
        assert sorted(c.path for c in gone) == ["cell-a/step-1.pt", "cell-a/step-2.pt"]
        assert sorted(p.name for p in (d.watch / "cell-a").iterdir()) == ["last.pt", "step-3.pt", "step-4.pt"]
        listing = d.listing()
        assert len(listing.claims) == 5 and not listing.pending  # still current, still demanded
        for c in gone:
            data = b"".join(
                ch.data for ch in d.stub.ReadArtifact(pb.ReadArtifactRequest(path=c.path), timeout=30)
            )
            assert blake3.blake3(data).hexdigest() == digests[c.path] == c.blake3
            assert (d.store / c.path).exists()  # never deleted from durable storage
        events = [(pb.EventKind.Name(e.kind), e.path) for e in d.events()]
        assert sorted(p for k, p in events if k == "ARTIFACT_RETIRED") == [
            "cell-a/step-1.pt",
            "cell-a/step-2.pt",
        ]
        assert not [p for k, p in events if k == "ARTIFACT_REMOVED"]  # their leaving ended no claim
        wait_until(
            lambda: (
                next(
                    iter(d.stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=10))
                ).artifacts.durable_only
                == 2
            ),
            timeout=10,
            what="the health stream counting two durable-only claims",
        )
        # A new file at a retired path is a new claim; the retired copy is kept aside, not replaced:
        # even with the same size, and perhaps the freed inode number of the deleted copy.
        again = os.urandom(50_001)
        (d.watch / "cell-a" / "step-1.pt").write_bytes(again)
        want = blake3.blake3(again).hexdigest()
        # (Its step is not among the last two: retention may retire it again once it is durable.)
        wait_until(
            lambda: any(c.path == "cell-a/step-1.pt" and c.durable and c.blake3 == want for c in d.claims()),
            timeout=30,
            what="the new step-1 claim",
        )
        attic = [p for p in (d.store / ".boxwarden-attic").rglob("step-1.pt")]
        assert (
            len(attic) == 1
            and blake3.blake3(attic[0].read_bytes()).hexdigest() == digests["cell-a/step-1.pt"]
        )
        # The only copy of step-2 rots: a read through the sidecar fails, and the claim says so.
        copy = d.store / "cell-a" / "step-2.pt"
        copy.write_bytes(b"x" + copy.read_bytes()[1:])
        with pytest.raises(grpc.RpcError):
            b"".join(
                ch.data
                for ch in d.stub.ReadArtifact(pb.ReadArtifactRequest(path="cell-a/step-2.pt"), timeout=30)
            )
        bad = wait_until(
            lambda: next((c for c in d.claims() if c.path == "cell-a/step-2.pt" and not c.durable), None),
            timeout=30,
            what="the rotten durable-only claim not durable",
        )
        assert bad.durable_only


def test_a_config_with_rules_that_cannot_mean_anything_is_refused(tmp_path: Path) -> None:
    from tests.sidecar.daemon import make_daemon

    d = make_daemon(tmp_path, tmp_path, keep="last=0")
    r = d.run_foreground()
    assert r.returncode != 0 and "field keep" in r.stderr and "at least 1" in r.stderr


def test_ledger_records_proofs_and_durable_only_across_a_reopen(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite")
    c = ledger.add_claim("a.pt", 1, "0" * 64, FileIdentity(1, 2, 1, 3, 4))
    assert not ledger.set_durable_only(c.id, True)  # not durable: its box copy must stay
    assert ledger.mark_durable(c.id, "server-checksum") and ledger.set_durable_only(c.id, True)
    assert ledger.summary().server_checksum == 1 and ledger.summary().durable_only == 1
    ledger.close()
    again = Ledger(tmp_path / "l.sqlite")
    got = again.current("a.pt")
    assert got is not None and (got.proof, got.durable_only) == ("server-checksum", True)
    again.close()


def test_a_durable_only_copy_stays_the_retired_one_even_when_a_proof_of_it_failed(tmp_path: Path) -> None:
    """Its box copy is gone: a later failed proof (durable = 0) must not let a new file's copy
    replace it at its path; it is the copy `_keep_retired` moves aside."""
    ledger = Ledger(tmp_path / "l.sqlite")
    c = ledger.add_claim("c/step-1.pt", 1, "0" * 64, FileIdentity(1, 2, 1, 3, 4))
    assert ledger.mark_durable(c.id, "reread") and ledger.set_durable_only(c.id, True)
    ledger.mark_not_durable(c.id, "MISMATCH: a proof failed")
    assert ledger.end_claim("c/step-1.pt", "a new file took the path", "ARTIFACT_REMOVED")
    kept = ledger.retired_copy("c/step-1.pt")
    assert kept is not None and kept.id == c.id
    ledger.close()


def test_retention_keeps_what_a_running_job_was_told_to_resume_from(tmp_path: Path) -> None:
    asyncio.run(_keeps_the_resume_source(tmp_path))


async def _keeps_the_resume_source(tmp_path: Path) -> None:
    watch, durable = tmp_path / "watch", tmp_path / "durable"
    (watch / "c" / "checkpoint-2").mkdir(parents=True)
    (watch / "c" / "checkpoint-4").mkdir(parents=True)
    durable.mkdir()
    store = open_store(durable.as_uri(), ("box", "run"))
    ledger = Ledger(tmp_path / "ledger.sqlite")
    files = ["c/step-1.pt", "c/checkpoint-2/model.safetensors", "c/checkpoint-2/state.json", "c/step-3.pt"]
    files += ["c/checkpoint-4/model.safetensors"]
    for art in files:
        f = watch / art
        f.write_bytes(os.urandom(1000))
        staged = store.stage(f, art)
        store.commit(staged)
        c = ledger.add_claim(art, staged.size, staged.digest, FileIdentity.of(f.stat()))
        assert ledger.mark_durable(c.id, "reread")
    protected = ["c/step-1.pt", "c/checkpoint-2"]  # a file, and a checkpoint's directory
    with ThreadPoolExecutor(2) as pool:
        sealer = make_sealer(watch, ledger, store, pool, settle_s=0.05)
        # `last=1` lets go of step 1 and checkpoint 2: what the jobs resume from stays.
        assert await Retainer(sealer, parse_keep("last=1"), protected=lambda: protected).once() == 0
        assert all((watch / art).exists() for art in files)
        protected = []  # those runs ended
        assert await Retainer(sealer, parse_keep("last=1"), protected=lambda: protected).once() == 3
    assert sorted(str(p.relative_to(watch)) for p in watch.rglob("*") if p.is_file()) == [
        "c/checkpoint-4/model.safetensors",
        "c/step-3.pt",
    ]
    ledger.close()
    store.close()
