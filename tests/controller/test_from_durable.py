"""The controller's side of a gone box, without a sidecar: the last claims list kept in the state
DB, and pulls from a real durable directory laid out as a sidecar lays it out
(`<store>/<box>/<run id>/<path>`), with the refusals: a claim not durable in the list, a copy
missing, of other bytes or longer, a symlink, the store's own names. Plus the routing of a
durable-only claim away from the box's bulk channel."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

import blake3
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import boxsource, fromdurable
from controller.digest import manifest_digest, path_key
from controller.errors import StateError, TransferError
from controller.lastlist import DurablePull, LastList, merged
from controller.manifest import ManifestFile
from controller.pull import PullReport
from controller.state import Box, State
from controller.verify import verify_tree

BOX, RUN = "b1", "run-1"
FILES = {
    "cell-a/best.bin": b"the best weights" * 1000,
    "cell-a/metrics.json": b'{"loss": 0.25}',
    "cell-b/best.bin": b"other weights" * 500,
    "empty.bin": b"",
}


def claims_of(files: dict[str, bytes], **fields: object) -> list[pb.Claim]:
    return [
        pb.Claim(path=p, size=len(b), blake3=blake3.blake3(b).hexdigest(), sealed_at_unix_ns=10**18, **fields)  # type: ignore[arg-type]
        for p, b in sorted(files.items())
    ]


def listing_of(claims: list[pb.Claim]) -> pb.ListArtifactsResponse:
    entries = [ManifestFile(c.path, c.size, c.blake3, "") for c in claims]
    return pb.ListArtifactsResponse(
        claims=claims, manifest_digest=manifest_digest(entries), total_claims=len(claims)
    )


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A durable directory holding the run's copies, and the store's own files beside them."""
    root = tmp_path / "store"
    corner = root / BOX / RUN
    for p, b in FILES.items():
        (corner / p).parent.mkdir(parents=True, exist_ok=True)
        (corner / p).write_bytes(b)
    (corner / ".boxwarden-owner").write_text("ledger-id")
    (corner / ".boxwarden-tmp").mkdir()
    (corner / ".boxwarden-tmp" / "in-flight").write_bytes(b"half")
    return root


@pytest.fixture
def state(tmp_path: Path, store: Path) -> State:
    s = State(tmp_path / "home")
    s.put(
        Box(
            name=BOX,
            profile="local",
            box_dir=str(tmp_path / "home" / "boxes" / BOX),
            state_dir=str(tmp_path / "gone-state"),
            socket=str(tmp_path / "gone.sock"),
            workdir=str(tmp_path / "gone-work"),
            watch=(str(tmp_path / "gone-work" / "ckpt"),),
            durable=store.as_uri(),
            run_id=RUN,
        )
    )
    return s


def keep(state: State, claims: list[pb.Claim], at_ns: int = 0, seq: int = 0) -> LastList:
    box = state.get(BOX)
    hello = pb.HelloResponse(
        box_name=BOX,
        run_id=RUN,
        watch_dirs=list(box.watch),
        state_dir=box.state_dir,
        durable_url=box.durable,
        durable_root=f"{box.durable}/{BOX}/{RUN}",
    )
    listing = listing_of(claims)
    listing.seq = seq
    last = LastList(BOX, RUN, at_ns or 10**18, box.durable, hello, listing)
    state.keep_last_list(last)
    return last


def pull(state: State, to: Path) -> PullReport:
    return asyncio.run(fromdurable.pull_durable(state, state.get(BOX), to, None, None))


def test_the_last_list_keeps_every_field_and_a_later_list_wins(state: State) -> None:
    claims = claims_of(FILES, durable=True, proof="server-checksum", durable_only=True)
    kept = keep(state, claims, at_ns=2 * 10**18, seq=20)
    got = state.last_list(BOX)
    assert got is not None and got == kept
    assert [(c.proof, c.durable_only) for c in got.listing.claims] == [("server-checksum", True)] * 4
    # Taken earlier in the box's journal, stored later (a slow command, a clock stepped forward): ignored.
    keep(state, claims[:1], at_ns=3 * 10**18, seq=10)
    got = state.last_list(BOX)
    assert got is not None and len(got.listing.claims) == 4
    keep(state, claims[:1], at_ns=10**18, seq=30)  # newer in the journal, whatever this clock says
    got = state.last_list(BOX)
    assert got is not None and len(got.listing.claims) == 1 and got.received_at.endswith("Z")
    assert state.last_list("other") is None and state.durable_pull(BOX) is None
    done = DurablePull(BOX, RUN, "d" * 64, 3, "/tree", 4)
    state.record_durable_pull(done)
    assert state.durable_pull(BOX) == done


def test_a_state_db_of_an_older_version_gains_the_tables(tmp_path: Path, state: State) -> None:
    keep(state, claims_of(FILES, durable=True))
    state.close()
    db = sqlite3.connect(tmp_path / "home" / "state.db")
    db.execute("DROP TABLE last_claims")
    db.execute("DROP TABLE durable_pulls")
    db.commit()
    db.close()
    again = State(tmp_path / "home")
    assert again.last_list(BOX) is None  # nothing invented: no list was kept in that DB
    keep(again, claims_of(FILES, durable=True))
    assert again.last_list(BOX) is not None
    again.close()
    State(tmp_path / "home").close()  # and opening it again changes nothing


def test_pages_merge_into_the_list_they_are_pages_of() -> None:
    claims = claims_of(FILES, durable=True)
    whole = listing_of(claims)
    pages = [
        pb.ListArtifactsResponse(
            claims=claims[:2], manifest_digest=whole.manifest_digest, next_page_token="t"
        ),
        pb.ListArtifactsResponse(
            claims=claims[2:], manifest_digest=whole.manifest_digest, total_claims=len(claims)
        ),
    ]
    assert merged(pages) == whole


def test_every_durable_claim_is_pulled_and_nothing_of_the_store_s_own(state: State, tmp_path: Path) -> None:
    keep(state, claims_of(FILES, durable=True))
    to = tmp_path / "pulled"
    rep = pull(state, to)
    assert rep.source == "durable" and sorted(rep.fetched) == sorted(FILES)
    for p, b in FILES.items():
        assert (to / p).read_bytes() == b
    assert sorted(os.listdir(to)) == ["MANIFEST.json", "cell-a", "cell-b", "empty.bin"]
    assert verify_tree(to, write_marker=True, verifier_version="t").ok
    done = state.durable_pull(BOX)
    assert done is not None and done.pulled_dir == str(to) and done.manifest_digest == rep.manifest.digest
    assert state.get(BOX).pulled_dir == str(to)
    again = pull(state, to)  # a second pull finds every file in place
    assert sorted(again.skipped) == sorted(FILES) and not again.fetched


def test_a_claim_not_durable_in_the_list_fails_the_pull_naming_it(state: State, tmp_path: Path) -> None:
    claims = claims_of(FILES, durable=True)
    claims[1].durable = False
    claims[1].push_error = "disk full"
    keep(state, claims)
    to = tmp_path / "pulled"
    with pytest.raises(TransferError, match=r"cell-a/metrics.json: not durable .*disk full"):
        pull(state, to)
    assert (to / "cell-a" / "best.bin").read_bytes() == FILES["cell-a/best.bin"]  # the others came
    assert not (to / "cell-a" / "metrics.json").exists() and not (to / "MANIFEST.json").exists()
    assert state.durable_pull(BOX) is None  # not a pull `down --box-gone` may judge


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda f: f.unlink(), "no durable copy at"),
        (lambda f: f.write_bytes(b"x" * len(f.read_bytes())), "never placed"),  # same size, other bytes
        (lambda f: f.write_bytes(f.read_bytes() + b"tail"), "holds more bytes"),
        (lambda f: (f.unlink(), f.symlink_to(f.with_name("metrics.json"))), "symlink: never followed"),
    ],
    ids=["missing", "other bytes", "longer", "symlink"],
)
def test_a_copy_that_is_not_the_claim_s_is_never_placed(
    state: State, store: Path, tmp_path: Path, damage: object, said: str
) -> None:
    keep(state, claims_of(FILES, durable=True))
    damage(store / BOX / RUN / "cell-a" / "best.bin")  # type: ignore[operator]
    to = tmp_path / "pulled"
    with pytest.raises(TransferError, match=r"cell-a/best\.bin") as e:
        pull(state, to)
    assert said in str(e.value)
    assert not (to / "cell-a" / "best.bin").exists()
    assert not list(to.glob(".bw-parts/*.part"))  # nothing of other bytes kept to resume from


def test_a_directory_symlinked_into_the_corner_is_never_followed(
    state: State, store: Path, tmp_path: Path
) -> None:
    keep(state, claims_of(FILES, durable=True))
    corner = store / BOX / RUN
    elsewhere = tmp_path / "elsewhere"
    (corner / "cell-b").rename(elsewhere)
    (corner / "cell-b").symlink_to(elsewhere)
    with pytest.raises(TransferError, match=r"cell-b/best\.bin.*symlink"):
        pull(state, tmp_path / "pulled")


def test_the_store_s_own_names_are_never_read_even_when_listed(state: State, tmp_path: Path) -> None:
    files = {**FILES, ".boxwarden-tmp/in-flight": b"half"}
    keep(state, claims_of(files, durable=True))
    with pytest.raises(TransferError, match=r"\.boxwarden-tmp/in-flight.*durable store's own name"):
        pull(state, tmp_path / "pulled")


def test_a_partial_copy_resumes_and_a_wrong_partial_is_fetched_again(state: State, tmp_path: Path) -> None:
    keep(state, claims_of(FILES, durable=True))
    to = tmp_path / "pulled"
    parts = to / ".bw-parts"
    parts.mkdir(parents=True, mode=0o700)
    data = FILES["cell-a/best.bin"]
    (parts / f"{path_key('cell-a/best.bin')}.part").write_bytes(data[:5000])
    (parts / f"{path_key('cell-b/best.bin')}.part").write_bytes(b"junk" * 100)
    rep = pull(state, to)
    assert rep.resumed == {"cell-a/best.bin": 5000, "cell-b/best.bin": 400}
    assert rep.restarted == ["cell-b/best.bin"]
    assert (to / "cell-a" / "best.bin").read_bytes() == data
    assert (to / "cell-b" / "best.bin").read_bytes() == FILES["cell-b/best.bin"]


def test_without_a_list_of_this_run_nothing_is_read(state: State, tmp_path: Path) -> None:
    with pytest.raises(StateError, match="no claims list was ever received"):
        pull(state, tmp_path / "pulled")
    keep(state, claims_of(FILES, durable=True))
    state.put(state.get(BOX).with_(run_id="run-2"))
    with pytest.raises(StateError, match="is of run run-1, and the box runs run-2"):
        pull(state, tmp_path / "pulled")


def test_reprove_names_each_copy_that_no_longer_equals_its_claim(state: State, store: Path) -> None:
    claims = claims_of(FILES, durable=True)
    claims[3].durable = False
    last = keep(state, claims)
    reader = fromdurable.open_reader(last, state.get(BOX), None)
    assert [r.path for r in asyncio.run(fromdurable.reprove(last, reader))] == ["empty.bin"]
    (store / BOX / RUN / "cell-b" / "best.bin").write_bytes(b"rot")
    (store / BOX / RUN / "cell-a" / "metrics.json").unlink()
    reasons = asyncio.run(fromdurable.reprove(last, reader))
    assert [(r.code, r.path) for r in reasons] == [
        ("NOT_DURABLE", "cell-a/metrics.json"),
        ("NOT_DURABLE", "cell-b/best.bin"),
        ("NOT_DURABLE", "empty.bin"),
    ]
    assert "no longer hashes to the claim" in reasons[1].detail


def test_a_durable_only_claim_never_goes_to_the_box_side_sender() -> None:
    """Retention deleted its box-side file: only the sidecar's ReadArtifact (from the durable store)
    can give its bytes, whatever its size."""
    bulk = boxsource.Bulk(sender=object(), watch_dirs=("/w",))  # type: ignore[arg-type]
    big = boxsource.BULK_MIN
    assert boxsource.comes_in_bulk(pb.Claim(path="a", size=big), bulk)
    assert not boxsource.comes_in_bulk(pb.Claim(path="a", size=big, durable_only=True), bulk)
    assert not boxsource.comes_in_bulk(pb.Claim(path="a", size=big - 1), bulk)
    assert not boxsource.comes_in_bulk(pb.Claim(path="a", size=big), None)
