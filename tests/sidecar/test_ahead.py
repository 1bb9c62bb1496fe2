"""Speculative streaming: a big checkpoint is pushed while it is still being written; at its seal
the one full read pass rewrites only what changed, and the claim is the digest of the sealed bytes
whatever was pushed ahead (a writer that went back over earlier bytes never makes a false claim)."""

from __future__ import annotations

import os
from pathlib import Path

import blake3

from sidecar.storage.local import LocalStore
from tests.conftest import wait_until
from tests.sidecar.daemon import running

KIB, MIB = 1 << 10, 1 << 20


def test_a_copy_pushed_ahead_is_finished_by_the_seal_with_the_sealed_bytes(tmp_path: Path) -> None:
    (tmp_path / "durable").mkdir()
    store = LocalStore((tmp_path / "durable").resolve(), chunk_size=64 * KIB)
    src = tmp_path / "ckpt.pt"
    first = os.urandom(300 * KIB)
    with open(src, "wb") as w:
        w.write(first)
        w.flush()
        st = os.fstat(w.fileno())
        ahead = store.begin_ahead("cell/ckpt.pt", (st.st_dev, st.st_ino))
        fd = os.open(src, os.O_RDONLY)
        try:
            store.push_ahead(ahead, fd, 300 * KIB)
            assert ahead.done == 256 * KIB and sorted(ahead.chunks) == [0, 64 * KIB, 128 * KIB, 192 * KIB]
            # The writer goes back over chunk 1, then writes on.
            w.seek(70 * KIB)
            w.write(b"\xff" * 10)
            w.seek(0, os.SEEK_END)
            w.write(os.urandom(100 * KIB))
        finally:
            os.close(fd)
    final = src.read_bytes()
    assert blake3.blake3(final[: 64 * KIB]).digest() == ahead.chunks[0][0]  # chunk 0 is kept as pushed
    assert blake3.blake3(final[64 * KIB : 128 * KIB]).digest() != ahead.chunks[64 * KIB][0]  # written again
    staged = store.stage(src, "cell/ckpt.pt", ahead=ahead)
    assert staged.digest == blake3.blake3(final).hexdigest() and staged.size == len(final)
    store.commit(staged)
    assert store.verify("cell/ckpt.pt", staged.digest) == "reread"
    assert (store.root / "cell" / "ckpt.pt").read_bytes() == final
    store.close()


def test_a_copy_pushed_ahead_from_another_file_is_discarded_not_used(tmp_path: Path) -> None:
    (tmp_path / "durable").mkdir()
    store = LocalStore((tmp_path / "durable").resolve(), chunk_size=64 * KIB)
    src = tmp_path / "ckpt.pt"
    src.write_bytes(os.urandom(200 * KIB))
    st = src.stat()
    ahead = store.begin_ahead("ckpt.pt", (st.st_dev, st.st_ino))
    fd = os.open(src, os.O_RDONLY)
    store.push_ahead(ahead, fd, st.st_size)
    os.close(fd)
    replacement = tmp_path / "new.pt"
    replacement.write_bytes(os.urandom(200 * KIB))
    os.replace(replacement, src)  # another inode at the path: what was pushed is not its bytes
    staged = store.stage(src, "ckpt.pt", ahead=ahead)
    store.commit(staged)
    assert (store.root / "ckpt.pt").read_bytes() == src.read_bytes()
    assert list((store.root / ".boxwarden-tmp").iterdir()) == []  # the discarded temp is gone
    store.close()


def test_a_sidecar_pushes_a_growing_checkpoint_ahead_and_claims_only_the_sealed_bytes(tmp_path: Path) -> None:
    with running(tmp_path, ahead_min_bytes=8 * MIB) as d:
        path = d.watch / "cell-a" / "big.pt"
        path.parent.mkdir()
        tmp_dir = d.store / ".boxwarden-tmp"
        with open(path, "wb") as w:
            w.write(os.urandom(24 * MIB))
            w.flush()

            def pushed() -> int:
                sizes = [p.stat().st_size for p in tmp_dir.iterdir()] if tmp_dir.exists() else []
                return max(sizes, default=0)

            wait_until(lambda: pushed() >= 16 * MIB, timeout=30, what="the copy pushed ahead")
            w.seek(MIB)
            w.write(os.urandom(4096))  # back over bytes already pushed
            w.seek(0, os.SEEK_END)
            w.write(os.urandom(9 * MIB + 123))
        final = blake3.blake3(path.read_bytes()).hexdigest()
        (claim,) = d.wait_durable(1)
        assert claim.blake3 == final
        assert blake3.blake3((d.store / "cell-a" / "big.pt").read_bytes()).hexdigest() == final
        durable = [e for e in d.events() if e.path == "cell-a/big.pt" and "pushed ahead" in e.detail]
        assert len(durable) == 1 and "proof: reread" in durable[0].detail
