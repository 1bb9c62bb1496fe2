"""The real sidecar process over its real Unix socket: sealing rules, claims, durability, the
journal, restarts, path refusals and socket permissions."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import blake3
import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from tests.conftest import save_ckpt, wait_until
from tests.sidecar.daemon import make_daemon, running


def b3(path: Path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()


def test_close_after_write_is_sealed_pushed_and_proven(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        save_ckpt(d.watch / "cell-a" / "best.pt", seed=1)
        (claim,) = d.wait_durable(1)
        src = d.watch / "cell-a" / "best.pt"
        assert claim.path == "cell-a/best.pt"
        assert claim.size == src.stat().st_size
        assert claim.blake3 == b3(src) == b3(d.store / "cell-a" / "best.pt")
        kinds = [pb.EventKind.Name(e.kind) for e in d.events()]
        assert kinds.index("ARTIFACT_SEALED") < kinds.index("ARTIFACT_DURABLE")
        # The temp name of the atomic save was never claimed nor pushed.
        assert not list(d.store.rglob("*.tmp"))


def test_temp_names_are_never_sealed_but_hidden_files_are(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        (d.watch / "a.part").write_bytes(b"partial")
        (d.watch / ".hidden").write_bytes(b"hidden")  # real data (e.g. DCP's .metadata)
        (d.watch / "x.tmp").write_bytes(b"tmp")
        (d.watch / "real.bin").write_bytes(b"real")
        assert sorted(c.path for c in d.wait_durable(2)) == [".hidden", "real.bin"]
        os.rename(d.watch / "x.tmp", d.watch / "x.bin")  # rename into place seals it
        paths = sorted(c.path for c in d.wait_durable(3))
        assert paths == [".hidden", "real.bin", "x.bin"]
        pending = {p.path: p.state for p in d.listing().pending}
        assert pending == {"a.part": pb.PENDING_TEMP}


def test_a_changed_file_gets_a_new_claim_not_an_edit(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        f = d.watch / "m.json"
        f.write_text('{"step": 1}')
        (first,) = d.wait_durable(1)
        f.write_text('{"step": 2, "more": true}')
        second = wait_until(
            lambda: [c for c in d.claims() if c.blake3 != first.blake3 and c.durable], what="the new claim"
        )[0]
        assert second.seq > first.seq
        assert second.blake3 == b3(f) == b3(d.store / "m.json")
        sealed = [e for e in d.events() if e.kind == pb.ARTIFACT_SEALED and e.path == "m.json"]
        assert [e.blake3 for e in sealed] == [first.blake3, second.blake3]


def test_restart_reuses_the_ledger_and_does_not_rehash(tmp_path: Path, sock_dir: Path) -> None:
    d = make_daemon(tmp_path, sock_dir)
    d.start()
    try:
        for i in range(3):
            save_ckpt(d.watch / f"c{i}.pt", seed=i)
        before = {c.path: (c.seq, c.blake3) for c in d.wait_durable(3)}
        last = d.events()[-1].seq
        d.kill(signal.SIGTERM)
        d.start()
        # A new file proves the restarted watcher and rescan run; the old ones keep their claims.
        save_ckpt(d.watch / "c9.pt", seed=9)
        after = {c.path: (c.seq, c.blake3) for c in d.wait_durable(4)}
        assert {k: after[k] for k in before} == before
        sealed_after = [e.path for e in d.events(after=last) if e.kind == pb.ARTIFACT_SEALED]
        assert sealed_after == ["c9.pt"]
    finally:
        d.kill(signal.SIGTERM)


def test_deleted_file_ends_its_claim(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        (d.watch / "a.bin").write_bytes(b"a")
        (d.watch / "b.bin").write_bytes(b"b")
        d.wait_durable(2)
        (d.watch / "a.bin").unlink()
        wait_until(lambda: [c.path for c in d.claims()] == ["b.bin"], what="the claim of a.bin to end")
        assert any(e.kind == pb.ARTIFACT_REMOVED and e.path == "a.bin" for e in d.events())


def test_read_artifact_refuses_what_is_not_a_current_claim(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        (d.watch / "a.bin").write_bytes(b"hello")
        (claim,) = d.wait_durable(1)
        data = b"".join(
            c.data for c in d.stub.ReadArtifact(pb.ReadArtifactRequest(path="a.bin", blake3=claim.blake3))
        )
        assert data == b"hello"
        tail = b"".join(c.data for c in d.stub.ReadArtifact(pb.ReadArtifactRequest(path="a.bin", offset=2)))
        assert tail == b"llo"
        cases = {
            "../../etc/passwd": grpc.StatusCode.INVALID_ARGUMENT,
            "/etc/passwd": grpc.StatusCode.INVALID_ARGUMENT,
            "nope.bin": grpc.StatusCode.NOT_FOUND,
        }
        for path, code in cases.items():
            with pytest.raises(grpc.RpcError) as e:
                list(d.stub.ReadArtifact(pb.ReadArtifactRequest(path=path)))
            assert e.value.code() == code, path
        with pytest.raises(grpc.RpcError) as e:
            list(d.stub.ReadArtifact(pb.ReadArtifactRequest(path="a.bin", blake3="0" * 64)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_socket_and_state_dir_permissions(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(d.socket.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(d.state).st_mode) == 0o700
    assert not d.socket.exists(), "the socket is removed on an orderly shutdown"


def test_second_sidecar_on_the_same_state_dir_refuses(tmp_path: Path, sock_dir: Path) -> None:
    with running(tmp_path):
        other = make_daemon(tmp_path, sock_dir)
        r = other.run_foreground()
        assert r.returncode == 2
        assert "another sidecar already runs" in r.stderr


def test_health_snapshot_has_disks_jobs_artifacts_and_self(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        (d.watch / "a.bin").write_bytes(b"x" * 1000)
        d.wait_durable(1)
        snaps = d.stub.WatchHealth(pb.WatchHealthRequest())
        first = next(snaps)
        second = wait_until(lambda: next(snaps), what="a second snapshot")
        snaps.cancel()
        assert second.at_unix_ns > first.at_unix_ns
        roles = {x.role for x in second.disks}
        assert roles == {"watch", "durable", "state", "root"}  # the workdir is the state dir here
        assert all(x.total_bytes >= x.free_bytes > 0 and x.total_inodes > 0 for x in second.disks)
        assert second.artifacts.sealed == 1 and second.artifacts.durable == 1
        assert second.artifacts.sealed_bytes == 1000 and second.artifacts.not_durable_bytes == 0
        assert second.self.rss_bytes > 10 << 20
        assert second.self.uptime_s > 0


def test_jobs_run_in_their_own_session_and_exit_codes_are_recorded(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        job = d.stub.StartJob(
            pb.StartJobRequest(argv=["sh", "-c", "echo hello from job; exit 7"], cell="cell-a"), timeout=10
        ).job
        assert job.pgid == job.pid != os.getpgid(0)
        done = wait_until(
            lambda: [
                j
                for j in d.stub.ListJobs(pb.ListJobsRequest(), timeout=5).jobs
                if j.state == pb.JOB_STATE_EXITED
            ],
            what="the job to exit",
        )[0]
        assert done.exit_code == 7
        log = b"".join(c.data for c in d.stub.TailLog(pb.TailLogRequest(job_id=job.id), timeout=10))
        assert b"hello from job" in log
        kinds = [(pb.EventKind.Name(e.kind), e.detail) for e in d.events() if e.job_id == job.id]
        assert kinds == [("JOB_STARTED", kinds[0][1]), ("JOB_EXITED", "7")]


def test_watch_events_streams_live_after_the_replay(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        last = d.events()[-1].seq
        stream = d.stub.WatchEvents(pb.WatchEventsRequest(after_seq=last), timeout=30)
        (d.watch / "live.bin").write_bytes(b"live")
        seen = []
        for e in stream:
            seen.append((pb.EventKind.Name(e.kind), e.path))
            if e.kind == pb.ARTIFACT_DURABLE:
                break
        stream.cancel()
        assert seen[0] == ("ARTIFACT_SEALED", "live.bin")
        assert seen[-1] == ("ARTIFACT_DURABLE", "live.bin")
