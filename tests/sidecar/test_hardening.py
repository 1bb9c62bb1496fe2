"""Regression tests for the failure modes a review found: each one failed before its fix."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import blake3
import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from tests.conftest import wait_until
from tests.sidecar.daemon import Daemon, make_daemon, running, short_dir


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


def _exited(d: Daemon, job_id: str) -> bool:
    jobs = d.stub.ListJobs(pb.ListJobsRequest(), timeout=5).jobs
    return any(j.id == job_id and j.state == pb.JOB_STATE_EXITED for j in jobs)


def test_no_job_starts_once_a_release_succeeded(tmp_path: Path) -> None:
    """F6: StartJob was refused only while the release held its lock; between a successful release
    and the controller's Shutdown a job could start, and ran on after `down` reported success."""
    with running(tmp_path) as d:
        (d.watch / "a.bin").write_bytes(b"aaaa")
        d.wait_durable(1)
        # A refused release deletes nothing and latches nothing: jobs still start after it.
        stale = d.stub.ReleaseArtifacts(pb.ReleaseArtifactsRequest(manifest_digest="0" * 64), timeout=30)
        assert [r.code for r in stale.refused] == ["MANIFEST_STALE"] and not stale.deleted
        job = d.stub.StartJob(pb.StartJobRequest(argv=["true"]), timeout=30).job
        wait_until(lambda: _exited(d, job.id), what="the job started after a refused release to exit")
        digest = d.listing().manifest_digest
        done = d.stub.ReleaseArtifacts(pb.ReleaseArtifactsRequest(manifest_digest=digest), timeout=30)
        assert list(done.deleted) == ["a.bin"] and not done.refused and not done.kept
        with pytest.raises(grpc.RpcError) as e:
            d.stub.StartJob(pb.StartJobRequest(argv=["true"]), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "released for its teardown" in (e.value.details() or "")
        assert "`boxwarden down t1 --confirm t1`" in (e.value.details() or "")
        # Still refused later on (the latch holds for the sidecar's life), and no job was recorded.
        with pytest.raises(grpc.RpcError):
            d.stub.StartJob(pb.StartJobRequest(argv=["true"]), timeout=30)
        assert [j.id for j in d.stub.ListJobs(pb.ListJobsRequest(), timeout=5).jobs] == [job.id]


def test_a_fifo_swapped_in_for_a_jobs_log_does_not_freeze_the_daemon(tmp_path: Path) -> None:
    """F7: TailLog opened the log with a blocking open() on the event loop: a FIFO put in its
    place (`rm L; mkfifo L`) blocked it for good, and the whole sidecar stopped answering."""
    with running(tmp_path) as d:
        job = d.stub.StartJob(pb.StartJobRequest(argv=["sh", "-c", "echo hi"]), timeout=30).job
        wait_until(lambda: _exited(d, job.id), what="the job to exit")
        chunks = d.stub.TailLog(pb.TailLogRequest(job_id=job.id), timeout=10)
        assert b"".join(c.data for c in chunks) == b"hi\n"
        log = Path(job.log_path)
        log.unlink()
        os.mkfifo(log)
        try:
            with pytest.raises(grpc.RpcError) as e:
                list(d.stub.TailLog(pb.TailLogRequest(job_id=job.id, follow=True), timeout=5))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
            assert "not a regular file but a fifo" in (e.value.details() or "")
            d.stub.Hello(pb.HelloRequest(), timeout=5)  # still answering
            log.unlink()
            (tmp_path / "elsewhere.txt").write_bytes(b"not the job's log")
            log.symlink_to(tmp_path / "elsewhere.txt")  # never followed either
            with pytest.raises(grpc.RpcError) as e:
                list(d.stub.TailLog(pb.TailLogRequest(job_id=job.id), timeout=5))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
            assert "replaced by a symlink" in (e.value.details() or "")
        finally:
            # A sidecar stuck in open() of the FIFO (the bug) is let go, so that it can be stopped.
            with contextlib.suppress(OSError):
                os.close(os.open(log, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_swapped_in_for_a_running_jobs_log_leaves_the_progress_probe_answering(tmp_path: Path) -> None:
    """Found by CI with F7: the progress probe's follower opened a job's log with a plain open(), so
    a FIFO put in its place while the job ran blocked the probe's thread for good (progress stale
    from then on, for every job) and once kept the sidecar from exiting on SIGTERM."""
    with running(tmp_path) as d:
        job = d.stub.StartJob(
            pb.StartJobRequest(argv=["sh", "-c", "echo step=7 loss=0.5; exec sleep 60"]), timeout=30
        ).job

        def progress_seen() -> bool:
            snap = next(iter(d.stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=5)))
            return any(j.id == job.id and j.progress.step == 7 for j in snap.jobs)

        wait_until(progress_seen, what="the job's progress in the health snapshot")
        log = Path(job.log_path)
        log.unlink()
        os.mkfifo(log)
        swapped = time.time_ns()
        seen: list[pb.HealthSnapshot] = []
        stream = d.stub.WatchHealth(pb.WatchHealthRequest(), timeout=60)
        for snap in stream:
            seen.append(snap)
            if snap.at_unix_ns > swapped + 4 * 10**9:  # past two probe timeouts (2 s) after the swap
                break
        stream.cancel()
        late = [s for s in seen if s.at_unix_ns > swapped]
        assert late, "no snapshot after the swap"
        for snap in late:
            (progress,) = [p for p in snap.probes if p.name == "progress"]
            assert not progress.stale, progress.error
            (scan,) = [p for p in snap.probes if p.name == "jobs"]  # the scan of /proc, off the loop
            assert not scan.stale, scan
            (j,) = [j for j in snap.jobs if j.id == job.id]
            assert j.progress.step == 7  # the last progress read stays
        d.stub.StopJob(pb.StopJobRequest(id=job.id, grace_s=1), timeout=30)


def test_a_fifo_at_a_release_aside_name_does_not_hang_the_start(tmp_path: Path, sock_dir: Path) -> None:
    """Found with F7: at start the sidecar hashes every `.bw-release.<claim id>` file to put back what
    an interrupted release renamed aside; it opened them with a blocking open(), so a FIFO of that
    name (a job can make one) kept the sidecar from ever answering."""
    d = make_daemon(tmp_path, sock_dir)
    d.start()
    aside = d.watch / ".bw-release.0"
    try:
        (d.watch / "a.bin").write_bytes(b"claimed")
        d.wait_durable(1)
        d.kill(signal.SIGTERM)
        db = sqlite3.connect(d.state / "ledger.sqlite")
        (claim_id,) = db.execute("SELECT id FROM claims WHERE current = 1").fetchone()
        db.close()
        aside = d.watch / f".bw-release.{claim_id}"
        os.mkfifo(aside)
        d.start()  # answers Hello
        assert stat.S_ISFIFO(aside.lstat().st_mode)  # left where it is: not the claim's bytes
        assert (d.watch / "a.bin").read_bytes() == b"claimed"
        assert [c.path for c in d.claims()] == ["a.bin"]
    finally:
        # A sidecar stuck in open() of the FIFO (the bug) is let go, so that it can be stopped.
        with contextlib.suppress(OSError):
            os.close(os.open(aside, os.O_WRONLY | os.O_NONBLOCK))
        d.kill(signal.SIGTERM)


FIFO_READS = """
import dataclasses, json, sys
from pathlib import Path
from sidecar.hashing import hash_file_read
from sidecar.jobrecord import JobRecord
fifo = Path(sys.argv[1])
job = JobRecord(id="j1", cell="", argv=["x"], cwd="/", env={}, pid=1, pgid=1, state="running",
                exit_code=None, started_at_ns=0, ended_at_ns=None, log_path=str(fifo.with_suffix(".log")),
                proc_start_ticks=1, keeper=[1, 1])
out = {"exit": job.recorded_exit(), "ended": job.keeper_ended()}
try:
    hash_file_read(fifo)
except OSError as e:
    out["hash"] = str(e)
print(json.dumps(out))
"""


def test_a_fifo_in_place_of_a_file_never_blocks_a_read(tmp_path: Path) -> None:
    """The keeper's status file (in the log dir, which a job can write) and a claimed file being
    hashed: a FIFO put there made open() wait for a writer forever (review 7, F7's kin)."""
    fifo = tmp_path / "j1.exit"
    os.mkfifo(fifo)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[2]), str(Path(__file__).parents[2] / "proto")]
        ),
    }
    r = subprocess.run(
        [sys.executable, "-c", FIFO_READS, str(fifo)], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert (
        r.stdout.strip()
        == '{"exit": null, "ended": false, "hash": "[Errno 22] not a regular file but a fifo: \''
        + str(fifo)
        + "'\"}"
    )


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_sidecar_goes_on(tmp_path: Path) -> None:
    """What a sidecar that will not stop or answer waits for, without a debugger on the box."""
    with running(tmp_path) as d:
        assert d.proc is not None
        log = d.root / "sidecar.log"
        os.kill(d.proc.pid, signal.SIGUSR1)
        wait_until(lambda: "_run_module_as_main" in log.read_text(), what="the stacks in the sidecar's log")
        text = log.read_text()
        assert "Thread 0x" in text and "sidecar/__main__.py" in text  # every thread, the main one too
        d.stub.Hello(pb.HelloRequest(), timeout=5)


def test_an_exiting_sidecar_leaves_the_pid_file_another_sidecar_wrote(tmp_path: Path) -> None:
    """Found by `make demo`: a sidecar still draining after SIGTERM, whose state dir had been deleted
    and made again, unlinked the pid file of the sidecar started there since."""
    with running(tmp_path) as d:
        assert d.proc is not None
        pid_file = d.state / "sidecar.pid"
        assert pid_file.read_text().strip() == str(d.proc.pid)
        pid_file.write_text("4242\n")  # another sidecar's, written since
        d.kill(signal.SIGTERM)
        assert pid_file.read_text() == "4242\n"
    with running(tmp_path) as d:  # its own it removes as it exits
        assert d.proc is not None
        pid_file = d.state / "sidecar.pid"
        wait_until(lambda: pid_file.read_text().strip() == str(d.proc.pid), what="the new pid file")
        d.kill(signal.SIGTERM)
        assert not pid_file.exists()
