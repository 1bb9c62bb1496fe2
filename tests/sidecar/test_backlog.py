"""Pushes that fail say why, retry with backoff, drain by themselves when room comes back, and
drain on demand (the Drain RPC) and on SIGTERM; NEXT_SAVE_WONT_FIT warns before a save fails.
Real sidecars on real tmpfs mounts (size= and nr_inodes=)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.backlog import RETRY_CAP_S, Backlog, Bandwidth
from sidecar.ledger import Ledger
from tests.conftest import wait_until
from tests.sidecar.daemon import Daemon, running

MIB = 1 << 20


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def write(path: Path, size: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = os.urandom(size)
    path.write_bytes(data)
    return blake3.blake3(data).hexdigest()


def kinds(d: Daemon) -> list[tuple[str, str, str]]:
    return [(pb.EventKind.Name(e.kind), e.path, e.detail) for e in d.events()]


def failed_with(d: Daemon, reason: str) -> list[pb.Claim] | None:
    cs = d.claims()
    return cs if cs and all(not c.durable and c.push_error.startswith(reason + ":") for c in cs) else None


# --- backoff -----------------------------------------------------------------------------------


def test_retries_back_off_exponentially_with_jitter_and_a_cap(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite")

    async def nothing() -> int:
        return 0

    def backlog(jitter: float) -> Backlog:
        return Backlog(
            ledger=ledger, push_pending=nothing, busy=lambda: 0, bandwidth=Bandwidth(), jitter=lambda: jitter
        )

    low, high = backlog(0.0), backlog(0.999)
    seen = []
    for attempt in range(12):
        low.attempt = high.attempt = attempt
        seen.append((low.delay(), high.delay()))
    # [d/2, d): never zero, never in step, doubling until the cap.
    assert seen[0][0] == 0.5 and seen[1][0] == 1.0 and seen[2][0] == 2.0
    assert all(lo < hi <= 2 * lo for lo, hi in seen)
    assert max(hi for _, hi in seen) <= RETRY_CAP_S and seen[-1][0] == RETRY_CAP_S / 2
    ledger.close()


def test_bandwidth_is_bytes_over_push_time_of_the_recent_pushes() -> None:
    b = Bandwidth(window=2)
    assert b.bytes_per_s() == 0.0
    b.add(100, 1.0)
    b.add(300, 1.0)
    assert b.bytes_per_s() == 200.0
    b.add(1000, 0.0)  # no time measured: ignored
    b.add(600, 2.0)  # the window keeps the last two
    assert b.bytes_per_s() == 300.0


# --- failures on real full filesystems ---------------------------------------------------------


def test_a_full_durable_store_fails_with_no_space_and_drains_when_room_comes_back(tmp_path: Path) -> None:
    with (
        tmpfs(tmp_path / "durable", "size=4m") as durable,
        running(tmp_path, durable_url=durable.as_uri()) as d,
    ):
        filler = durable / "filler"
        filler.write_bytes(b"\0" * (3 * MIB))
        digest = write(d.watch / "cell-a" / "step-1.pt", 2 * MIB)
        claims = wait_until(lambda: failed_with(d, "NO_SPACE"), timeout=30, what="NO_SPACE")
        assert [c.blake3 for c in claims] == [digest]
        assert any(k == "PUSH_FAILED" and "NO_SPACE" in detail for k, _, detail in kinds(d))
        at_risk = list(d.stub.Drain(pb.DrainRequest(), timeout=30))
        assert len(at_risk) == 1 and at_risk[0].done
        assert (at_risk[0].at_risk_files, at_risk[0].at_risk_bytes) == (1, 2 * MIB)
        assert at_risk[0].at_risk[0].push_error.startswith("NO_SPACE:")
        filler.unlink()  # room again: the push is retried at once, not at the next backoff step
        d.wait_durable(1, timeout=15)
        assert (d.store / "cell-a" / "step-1.pt").read_bytes()[:16] == (
            d.watch / "cell-a" / "step-1.pt"
        ).read_bytes()[:16]


def test_a_durable_store_out_of_inodes_says_so_and_nothing_is_claimed_durable(tmp_path: Path) -> None:
    with (
        tmpfs(tmp_path / "durable", "size=16m,nr_inodes=64") as durable,
        running(tmp_path, durable_url=durable.as_uri()) as d,
    ):
        write(d.watch / "a.pt", 1000)
        d.wait_durable(1)
        fillers = durable / "fillers"
        fillers.mkdir()
        made = 0
        with contextlib.suppress(OSError):
            while True:  # every inode left
                (fillers / str(made)).touch()
                made += 1
        assert made > 0 and os.statvfs(durable).f_favail == 0
        write(d.watch / "cell" / "b.pt", 2000)  # a new directory in the store, and a temp file
        wait_until(lambda: len(d.claims()) == 2, timeout=30, what="the second claim")
        b = wait_until(
            lambda: next((c for c in d.claims() if c.path == "cell/b.pt" and c.push_error), None),
            timeout=30,
            what="the push failure",
        )
        assert not b.durable and b.push_error.startswith("NO_INODES:"), b.push_error
        for f in list(fillers.iterdir())[:10]:
            f.unlink()
        d.wait_durable(2, timeout=15)


def test_next_save_wont_fit_fires_before_the_save_that_fails(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "watch", "size=3m") as watch, running(tmp_path) as d:
        write(watch / "step-1.pt", 2 * MIB)
        d.wait_durable(1)
        warned = wait_until(
            lambda: [e for e in kinds(d) if e[0] == "NEXT_SAVE_WONT_FIT"],
            timeout=10,
            what="NEXT_SAVE_WONT_FIT",
        )
        assert warned[0][1] == "step-1.pt" and "will fail" in warned[0][2]
        with pytest.raises(OSError) as e:
            write(watch / "step-2.pt", 2 * MIB)
        assert e.value.errno == errno.ENOSPC
        (watch / "step-2.pt").unlink()
        assert len([e for e in kinds(d) if e[0] == "NEXT_SAVE_WONT_FIT"]) == 1  # once per episode


# --- drain ---------------------------------------------------------------------------------------


def test_drain_waits_until_nothing_is_at_risk(tmp_path: Path) -> None:
    with (
        tmpfs(tmp_path / "durable", "size=8m") as durable,
        running(tmp_path, durable_url=durable.as_uri()) as d,
    ):
        filler = durable / "filler"
        filler.write_bytes(b"\0" * (7 * MIB))
        write(d.watch / "x.pt", MIB)
        wait_until(lambda: failed_with(d, "NO_SPACE"), timeout=30, what="NO_SPACE")
        stream = d.stub.Drain(pb.DrainRequest(wait=True, timeout_s=60), timeout=90)
        first = next(stream)
        assert first.at_risk_files == 1 and not first.done
        filler.unlink()
        rest = list(stream)
        assert rest[-1].done and rest[-1].at_risk_files == 0 and rest[-1].at_risk_bytes == 0
        assert rest[-1].push_bytes_per_s > 0
        assert all(c.durable for c in d.claims())


def test_a_drain_pushes_at_full_speed_whatever_the_pace(tmp_path: Path) -> None:
    """At 1 MB/s, the re-read of a 16 MiB copy takes 16 s after its seal; a drain lifts the pace,
    so the copy is proven well within the drain's 8 s."""
    with running(tmp_path, push_rate_bytes_s=1_000_000) as d:
        write(d.watch / "big.pt", 16 * MIB)
        wait_until(lambda: any(k == "ARTIFACT_SEALED" for k, _, _ in kinds(d)), timeout=60, what="the seal")
        assert not any(c.durable for c in d.claims())  # paced: its proof has 16 s to go
        last = list(d.stub.Drain(pb.DrainRequest(wait=True, timeout_s=8), timeout=60))[-1]
        assert last.done and last.at_risk_files == 0
        assert all(c.durable for c in d.claims())


def test_sigterm_drains_a_200mib_checkpoint_sealed_just_before_within_the_grace(tmp_path: Path) -> None:
    with running(tmp_path, drain_grace_s=30) as d:
        digest = write(d.watch / "cell-a" / "big.pt", 200 * MIB)
        wait_until(lambda: any(k == "ARTIFACT_SEALED" for k, _, _ in kinds(d)), timeout=60, what="the seal")
        assert d.proc is not None
        proc = d.proc
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=40) == 0
        d.proc = None
        db = sqlite3.connect(d.state / "ledger.sqlite")
        rows = db.execute("SELECT path, blake3, durable, proof FROM claims WHERE current = 1").fetchall()
        kinds_seen = [r[0] for r in db.execute("SELECT kind FROM events")]
        db.close()
        assert rows == [("cell-a/big.pt", digest, 1, "reread")]
        assert "DRAIN_UNFINISHED" not in kinds_seen
        assert blake3.blake3((d.store / "cell-a" / "big.pt").read_bytes()).hexdigest() == digest


def test_sigterm_journals_what_the_grace_could_not_save(tmp_path: Path) -> None:
    with (
        tmpfs(tmp_path / "durable", "size=2m") as durable,
        running(tmp_path, durable_url=durable.as_uri(), drain_grace_s=2) as d,
    ):
        write(d.watch / "big.pt", 3 * MIB)
        wait_until(lambda: failed_with(d, "NO_SPACE"), timeout=30, what="NO_SPACE")
        assert d.proc is not None
        proc = d.proc
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        d.proc = None
        db = sqlite3.connect(d.state / "ledger.sqlite")
        unfinished = [r[0] for r in db.execute("SELECT detail FROM events WHERE kind = 'DRAIN_UNFINISHED'")]
        db.close()
        assert len(unfinished) == 1 and "1 claims" in unfinished[0] and "big.pt" in unfinished[0]


def test_sigterm_waits_for_a_checkpoint_still_being_written_and_pushes_it(tmp_path: Path) -> None:
    """A trainer's own SIGTERM handler saving one last time: the file is open when the sidecar is
    told to go; the drain waits for it to be closed, seals it and proves its copy before exiting."""
    with running(tmp_path, drain_grace_s=20) as d:
        path = d.watch / "emergency.pt"
        assert d.proc is not None
        proc = d.proc
        with open(path, "wb") as w:
            w.write(os.urandom(8 * MIB))
            w.flush()
            wait_until(
                lambda: [p.path for p in d.listing().pending] == ["emergency.pt"],
                timeout=30,
                what="the pending entry",
            )
            os.kill(proc.pid, signal.SIGTERM)
            w.write(os.urandom(8 * MIB))
        digest = blake3.blake3(path.read_bytes()).hexdigest()
        assert proc.wait(timeout=40) == 0
        d.proc = None
        db = sqlite3.connect(d.state / "ledger.sqlite")
        rows = db.execute("SELECT path, blake3, durable FROM claims WHERE current = 1").fetchall()
        unfinished = db.execute("SELECT count(*) FROM events WHERE kind = 'DRAIN_UNFINISHED'").fetchone()[0]
        db.close()
        assert rows == [("emergency.pt", digest, 1)] and unfinished == 0
