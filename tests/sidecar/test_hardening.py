"""Regression tests for the failure modes a review found: each one failed before its fix."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import blake3
import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from tests.sidecar.daemon import make_daemon, running, short_dir


def b3(path: Path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()


def test_two_boxes_sharing_a_durable_url_keep_their_own_copies(tmp_path: Path) -> None:
    shared = tmp_path / "shared-durable"
    shared.mkdir()
    with short_dir() as s1, short_dir() as s2:
        a = make_daemon(tmp_path / "a", s1, box_name="box-a", durable_url=shared.as_uri())
        b = make_daemon(tmp_path / "b", s2, box_name="box-b", durable_url=shared.as_uri())
        a.start()
        b.start()
        try:
            (a.watch / "best.pt").write_bytes(b"AAA")
            (b.watch / "best.pt").write_bytes(b"BBBB")
            (ca,) = a.wait_durable(1)
            (cb,) = b.wait_durable(1)
            assert (shared / "box-a" / "default" / "best.pt").read_bytes() == b"AAA"
            assert (shared / "box-b" / "default" / "best.pt").read_bytes() == b"BBBB"
            assert ca.blake3 != cb.blake3
        finally:
            a.kill(signal.SIGTERM)
            b.kill(signal.SIGTERM)


def test_an_emptied_durable_store_is_not_trusted_after_a_restart(tmp_path: Path, sock_dir: Path) -> None:
    d = make_daemon(tmp_path, sock_dir)
    d.start()
    try:
        (d.watch / "a.bin").write_bytes(b"precious")
        d.wait_durable(1)
        d.kill(signal.SIGTERM)
        shutil.rmtree(d.store)  # the volume was wiped or another, empty one is mounted there
        d.start()
        (claim,) = d.wait_durable(1)
        assert (d.store / "a.bin").read_bytes() == b"precious"
        assert claim.blake3 == b3(d.store / "a.bin")
        assert any(e.kind == pb.PUSH_FAILED and "durable store changed" in e.detail for e in d.events())
    finally:
        d.kill(signal.SIGTERM)


def test_release_rereads_durable_copies_and_deletes_nothing_if_one_is_bad(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        (d.watch / "a.bin").write_bytes(b"aaaa")
        (d.watch / "b.bin").write_bytes(b"bbbb")
        d.wait_durable(2)
        (d.store / "b.bin").write_bytes(b"XXXX")  # same size, other bytes: bit rot, a bad volume
        digest = d.listing().manifest_digest
        resp = d.stub.ReleaseArtifacts(pb.ReleaseArtifactsRequest(manifest_digest=digest), timeout=30)
        assert list(resp.deleted) == []
        assert [(r.code, r.path) for r in resp.refused] == [("NOT_DURABLE", "b.bin")]
        assert (d.watch / "a.bin").exists() and (d.watch / "b.bin").exists()
        # The claim lost its durable mark, and the push retry proves a good copy again.
        claims = {c.path: c for c in d.wait_durable(2)}
        assert b3(d.store / "b.bin") == claims["b.bin"].blake3


def test_durable_dir_inside_a_watched_dir_is_refused(tmp_path: Path, sock_dir: Path) -> None:
    d = make_daemon(tmp_path, sock_dir)
    d.config.write_text(d.config.read_text().replace(d.durable.as_uri(), (d.watch / "backup").as_uri()))
    argv = [sys.executable, "-m", "sidecar", "--config", str(d.config)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "overlaps the watched directory" in r.stderr


def test_a_fifo_swapped_in_for_a_claimed_file_does_not_wedge_the_daemon(tmp_path: Path) -> None:
    with running(tmp_path, rescan_ms=600000) as d:
        (d.watch / "f.pt").write_bytes(b"x" * 100)
        d.wait_durable(1)
        os.mkfifo(tmp_path / "fifo")
        os.rename(tmp_path / "fifo", d.watch / "f.pt")
        with pytest.raises(grpc.RpcError) as e:
            list(d.stub.ReadArtifact(pb.ReadArtifactRequest(path="f.pt"), timeout=5))
        assert e.value.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND)
        d.stub.Hello(pb.HelloRequest(), timeout=5)  # still answering


def test_a_non_utf8_name_is_reported_not_claimed_and_breaks_nothing(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        os.close(os.open(os.fsencode(str(d.watch)) + b"/bad\xff.pt", os.O_WRONLY | os.O_CREAT, 0o644))
        (d.watch / "good.pt").write_bytes(b"good")
        (claim,) = d.wait_durable(1)
        assert claim.path == "good.pt"
        listing = d.listing()
        assert [c.path for c in listing.claims] == ["good.pt"]
        assert [(p.path, p.state) for p in listing.pending] == [("bad\\xff.pt", pb.PENDING_UNCLAIMABLE)]
        assert "rename it" in listing.pending[0].detail


def test_a_file_moved_in_from_outside_is_sealed_without_waiting_for_a_rescan(tmp_path: Path) -> None:
    with running(tmp_path, rescan_ms=600000) as d:
        outside = tmp_path / "elsewhere.pt"
        outside.write_bytes(b"moved in")
        os.rename(outside, d.watch / "moved.pt")
        # The rescan is 10 minutes away: only the watcher can have seen this file.
        (claim,) = d.wait_durable(1, timeout=30)
        assert claim.path == "moved.pt"
