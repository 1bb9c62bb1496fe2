"""The sidecar's side of the Iron Law: nothing in a watched dir is ignored, a changed file is always
noticed, only verified bytes are deleted. Each test failed on 34164bb (real daemon, real files)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from tests.conftest import wait_until
from tests.sidecar.daemon import Daemon, make_daemon, running


def b3(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


@pytest.fixture
def coarse_fs(tmp_path: Path) -> Iterator[Path]:
    """A loop-mounted ext4 with 128-byte inodes: timestamps are whole seconds there."""
    img, mnt = tmp_path / "coarse.img", tmp_path / "coarse"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "64M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(img)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    try:
        probe = mnt / "probe"
        probe.write_bytes(b"x")
        assert probe.stat().st_mtime_ns % 1_000_000_000 == 0, "expected whole-second timestamps"
        probe.unlink()
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def rewrite_keeping_size_and_mtime(f: Path, data: bytes) -> None:
    st = f.stat()
    assert len(data) == st.st_size
    with open(f, "r+b") as fh:
        fh.write(data)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # `touch -r` style: mtime as it was
    assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size


def claim_of(d: Daemon, path: str) -> pb.Claim | None:
    return next((c for c in d.claims() if c.path == path), None)


def open_paths(pid: int) -> set[str]:
    """What the process has open, by path (fds closed while looking are skipped)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return found


def read_all(d: Daemon, path: str) -> bytes:
    return b"".join(c.data for c in d.stub.ReadArtifact(pb.ReadArtifactRequest(path=path), timeout=10))


@pytest.mark.parametrize("fs", ["default", "whole-second ext4"])
def test_in_place_rewrite_keeping_size_and_mtime_is_sealed_again(
    tmp_path: Path, fs: str, request: pytest.FixtureRequest
) -> None:
    root = request.getfixturevalue("coarse_fs") if fs != "default" else tmp_path
    with running(root) as d:
        f = d.watch / "best.pt"
        old, new = b"A" * 4096, b"B" * 4096
        f.write_bytes(old)
        (first,) = d.wait_durable(1)
        assert first.blake3 == b3(old)
        rewrite_keeping_size_and_mtime(f, new)
        second = wait_until(
            lambda: (c := claim_of(d, "best.pt")) is not None and c.durable and c.blake3 == b3(new) and c,
            timeout=60,
            what="the rewrite to be sealed as a new claim",
        )
        assert second.seq > first.seq
        assert (d.store / "best.pt").read_bytes() == new
        assert read_all(d, "best.pt") == new


def test_a_byte_mismatch_found_by_a_read_seals_the_file_again(tmp_path: Path) -> None:
    """A claim whose identity still matches but whose bytes do not (two writes inside one timestamp
    tick, with the sidecar down) must not leave the box stuck: the read finds it, the file is
    sealed again, and the next read succeeds."""
    with running(tmp_path) as d:
        f = d.watch / "m.bin"
        f.write_bytes(b"real bytes")
        (claim,) = d.wait_durable(1)
        d.kill()
        db = sqlite3.connect(d.state / "ledger.sqlite")
        db.execute("UPDATE claims SET blake3 = ? WHERE current = 1", (b3(b"other bytes"),))
        db.commit()
        db.close()
        d.start()
        with pytest.raises(grpc.RpcError) as e:
            read_all(d, "m.bin")
        assert e.value.code() == grpc.StatusCode.ABORTED
        wait_until(
            lambda: (c := claim_of(d, "m.bin")) is not None and c.durable and c.blake3 == b3(b"real bytes"),
            what="the file to be sealed again with its real digest",
        )
        assert read_all(d, "m.bin") == b"real bytes"
        assert any(e.kind == pb.ARTIFACT_CHANGED and e.path == "m.bin" for e in d.events())
        assert claim.blake3 == b3(b"real bytes")


def test_hidden_files_hidden_dirs_and_temp_looking_dirs_are_claimed(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        files = {
            "dcp/.metadata": b"torch.distributed.checkpoint metadata",
            "dcp/__0_0.distcp": b"shard",
            ".hidden/w.bin": b"in a hidden dir",
            "run.tmp/final.pt": b"in a dir whose name looks temp",
            "a.part.d/x": b"x",
        }
        for rel, data in files.items():
            (d.watch / rel).parent.mkdir(parents=True, exist_ok=True)
            (d.watch / rel).write_bytes(data)
        claims = {c.path: c.blake3 for c in d.wait_durable(len(files))}
        assert claims == {rel: b3(data) for rel, data in files.items()}


def test_a_watched_dir_named_like_a_hidden_dir_is_watched(tmp_path: Path, sock_dir: Path) -> None:
    dot, other = tmp_path / ".checkpoints", tmp_path / "logs"
    dot.mkdir()
    other.mkdir()
    d = make_daemon(tmp_path, sock_dir)
    d.config.write_text(d.config.read_text().replace(str(d.watch), str(dot)).replace("]", f', "{other}"]', 1))
    d.start()
    try:
        (dot / "cell-a").mkdir()
        (dot / "cell-a" / "best.pt").write_bytes(b"ckpt")
        (other / "train.log").write_bytes(b"log")
        assert sorted(c.path for c in d.wait_durable(2)) == [".checkpoints/cell-a/best.pt", "logs/train.log"]
    finally:
        d.kill()


def test_symlinks_special_files_unlistable_dirs_and_long_paths_are_reported(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.pt").write_bytes(b"not in the watched dir")
    # Without CAP_DAC_OVERRIDE even root gets EACCES on a mode-000 dir, as a normal user would.
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    with running(tmp_path, prefix=drop) as d:
        (d.watch / "ok.bin").write_bytes(b"fine")
        os.symlink(elsewhere, d.watch / "linked")
        os.symlink(elsewhere / "secret.pt", d.watch / "link.pt")
        os.mkfifo(d.watch / "pipe")
        locked = d.watch / "locked"
        locked.mkdir()
        (locked / "inside.pt").write_bytes(b"cannot be seen")
        locked.chmod(0)
        # A path longer than PATH_MAX, built one relative step at a time.
        fd = os.open(d.watch, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for _ in range(20):
                os.mkdir("d" * 250, dir_fd=fd)
                nfd = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nfd
            wfd = os.open("deep.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
            os.write(wfd, b"deep")
            os.close(wfd)
        finally:
            os.close(fd)
        try:
            d.wait_durable(1)
            pending = {p.path: p for p in d.listing().pending}
            assert pending["linked"].state == pb.PENDING_UNCLAIMABLE and "symlink" in pending["linked"].detail
            assert pending["link.pt"].state == pb.PENDING_UNCLAIMABLE
            assert pending["pipe"].state == pb.PENDING_UNCLAIMABLE and "fifo" in pending["pipe"].detail
            assert pending["locked"].state == pb.PENDING_UNCLAIMABLE
            assert "cannot list" in pending["locked"].detail
            deep = [p for p in pending.values() if p.path.startswith("d" * 250)]
            assert deep and all(p.state == pb.PENDING_UNCLAIMABLE for p in deep)
            # And the release refuses while they are there, deleting nothing.
            resp = d.stub.ReleaseArtifacts(
                pb.ReleaseArtifactsRequest(manifest_digest=d.listing().manifest_digest), timeout=30
            )
            assert not resp.deleted
            assert {"UNCLAIMABLE"} == {r.code for r in resp.refused}
            assert (d.watch / "ok.bin").exists()
        finally:
            locked.chmod(0o755)


def test_a_dead_sidecar_is_not_restarted_on_other_watched_dirs(tmp_path: Path, sock_dir: Path) -> None:
    d = make_daemon(tmp_path, sock_dir)
    d.start()
    (d.watch / "a.bin").write_bytes(b"claimed")
    d.wait_durable(1)
    d.kill()
    other = tmp_path / "other"
    other.mkdir()
    d.config.write_text(d.config.read_text().replace(str(d.watch), str(other)))
    r = d.run_foreground()
    assert r.returncode == 2
    assert "holds 1 claims" in r.stderr and str(d.watch) in r.stderr
    # The claim was not ended with a false "deleted" reason.
    db = sqlite3.connect(d.state / "ledger.sqlite")
    assert db.execute("SELECT count(*) FROM claims WHERE current = 1").fetchone()[0] == 1
    db.close()


def test_another_ledger_never_writes_into_a_runs_durable_corner(tmp_path: Path, sock_dir: Path) -> None:
    a = make_daemon(tmp_path / "a", sock_dir, durable_url=(tmp_path / "shared").as_uri(), run_id="r1")
    (tmp_path / "shared").mkdir()
    a.start()
    (a.watch / "best.pt").write_bytes(b"run one")
    a.wait_durable(1)
    a.kill()
    b = make_daemon(tmp_path / "b", sock_dir, durable_url=(tmp_path / "shared").as_uri(), run_id="r1")
    r = b.run_foreground()
    assert r.returncode == 2
    assert "another run" in r.stderr
    assert (tmp_path / "shared" / "t1" / "r1" / "best.pt").read_bytes() == b"run one"


def test_release_never_replaces_a_file_at_the_aside_name(tmp_path: Path) -> None:
    """34164bb renamed `x` to `.x.bw-release` with a replacing rename: a file already there was lost."""
    with running(tmp_path) as d:
        (d.watch / "x.pt").write_bytes(b"claimed")
        (d.watch / ".x.pt.bw-release").write_bytes(b"precious, never pulled")
        d.wait_durable(2)  # not a temp name any more: it is claimed like any file
        resp = d.stub.ReleaseArtifacts(
            pb.ReleaseArtifactsRequest(manifest_digest=d.listing().manifest_digest), timeout=30
        )
        assert sorted(resp.deleted) == [".x.pt.bw-release", "x.pt"]
        assert (d.store / ".x.pt.bw-release").read_bytes() == b"precious, never pulled"


def test_release_is_exclusive_blocks_jobs_and_deletes_only_verified_bytes(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        big = os.urandom(1 << 20) * 96  # the release re-reads the durable copy first: it takes a while
        (d.watch / "big.bin").write_bytes(big)
        d.wait_durable(1)
        digest = d.listing().manifest_digest
        req = pb.ReleaseArtifactsRequest(manifest_digest=digest)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(d.stub.ReleaseArtifacts, req, timeout=120)
            second = pool.submit(d.stub.ReleaseArtifacts, req, timeout=120)
            answers = [first.result(), second.result()]
        busy = [a for a in answers if [r.code for r in a.refused] == ["RELEASE_RUNNING"]]
        done = [a for a in answers if list(a.deleted) == ["big.bin"]]
        assert len(busy) == 1 and len(done) == 1 and not done[0].refused
        assert not (d.watch / "big.bin").exists()
        assert (d.store / "big.bin").read_bytes() == big


def test_start_job_is_refused_while_a_release_runs(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        (d.watch / "big.bin").write_bytes(os.urandom(1 << 20) * 128)
        d.wait_durable(1)
        req = pb.ReleaseArtifactsRequest(manifest_digest=d.listing().manifest_digest)
        with ThreadPoolExecutor(1) as pool:
            release = pool.submit(d.stub.ReleaseArtifacts, req, timeout=120)
            refused = None
            # A program that cannot start: until the release runs, each try fails for that reason
            # (a job started just before the release would rightly make it refuse).
            probe = pb.StartJobRequest(argv=[str(tmp_path / "no-such-program")])
            while not release.done():
                try:
                    d.stub.StartJob(probe, timeout=10)
                except grpc.RpcError as e:
                    if "release" in (e.details() or ""):
                        refused = e
                        break
            assert release.result().deleted == ["big.bin"]
        assert refused is not None, "StartJob was never refused during the release"
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "release" in (refused.details() or "")


def test_listing_is_paged_over_one_snapshot(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        for i in range(7):
            (d.watch / f"f{i}.bin").write_bytes(b"%d" % i)
        (d.watch / "w.tmp").write_bytes(b"temp")
        d.wait_durable(7)
        pages, token = [], ""
        while True:
            page = d.stub.ListArtifacts(pb.ListArtifactsRequest(page_size=3, page_token=token), timeout=10)
            pages.append(page)
            token = page.next_page_token
            if not token:
                break
        assert len(pages) == 3
        assert {p.manifest_digest for p in pages} == {pages[0].manifest_digest}
        assert [c.path for p in pages for c in p.claims] == [f"f{i}.bin" for i in range(7)]
        assert [e.path for p in pages for e in p.pending] == ["w.tmp"]
        assert [p.total_claims for p in pages] == [7, 7, 7]
        # Pages of claims alone go out while the walk runs; its totals come with the last claim.
        assert [(p.total_pending, len(p.pending)) for p in pages] == [(0, 0), (0, 0), (1, 1)]
        with pytest.raises(grpc.RpcError) as e:
            d.stub.ListArtifacts(pb.ListArtifactsRequest(page_token=pages[0].next_page_token), timeout=10)
        assert e.value.code() == grpc.StatusCode.ABORTED  # the snapshot ended with its last page


def test_an_unknown_event_kind_does_not_break_the_stream(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        (d.watch / "a.bin").write_bytes(b"a")
        d.wait_durable(1)
        d.kill()
        db = sqlite3.connect(d.state / "ledger.sqlite")
        db.execute("INSERT INTO events(at_ns, kind, detail) VALUES (1, 'FROM_THE_FUTURE', 'hello')")
        db.commit()
        db.close()
        d.start()
        events = d.events()
        future = [e for e in events if e.kind == pb.EVENT_KIND_UNSPECIFIED]
        assert [e.detail for e in future] == ["FROM_THE_FUTURE: hello"]
        assert events[-1].kind == pb.SIDECAR_STARTED  # the replay went on past it


def test_os_errors_in_handlers_are_named_not_unknown(tmp_path: Path) -> None:
    with running(tmp_path) as d:
        job = d.stub.StartJob(pb.StartJobRequest(argv=["true"]), timeout=10).job
        wait_until(
            lambda: d.stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs[0].state != pb.JOB_STATE_RUNNING,
            what="the job to end",
        )
        os.unlink(job.log_path)
        with pytest.raises(grpc.RpcError) as e:
            list(d.stub.TailLog(pb.TailLogRequest(job_id=job.id), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "I/O error on the box" in (e.value.details() or "")


def test_a_job_child_that_clears_its_environment_and_leaves_the_session_keeps_the_job_running(
    tmp_path: Path,
) -> None:
    """`env -i setsid -f ...` drops the job's environment tag and its session; the process is
    reparented to the sidecar (a child subreaper), which still counts it as the job's."""
    pidfile = tmp_path / "escapee.pid"
    inner = f"echo $$ > {pidfile}; exec sleep 300"
    with running(tmp_path) as d:
        job = d.stub.StartJob(
            pb.StartJobRequest(argv=["sh", "-c", f"env -i /usr/bin/setsid -f /bin/sh -c '{inner}'"]),
            timeout=10,
        ).job
        pid = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the escapee"))
        try:

            def listed() -> pb.Job:
                return next(
                    j for j in d.stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs if j.id == job.id
                )

            seen = wait_until(lambda: (j := listed()).leader_exited and j, what="the leader to exit")
            assert seen.state == pb.JOB_STATE_RUNNING
            assert pid in seen.live_pids
        finally:
            os.kill(pid, 9)
        wait_until(lambda: listed().state == pb.JOB_STATE_EXITED, what="the job to end with its escapee")


def test_release_keeps_a_file_someone_holds_open_for_writing_and_puts_it_back(tmp_path: Path) -> None:
    from sidecar.identity import FileIdentity
    from sidecar.ledger import ClaimRow
    from sidecar.release import delete_verified

    f, aside = tmp_path / "best.pt", tmp_path / ".bw-release.1"
    f.write_bytes(b"claimed bytes")
    claim = ClaimRow(1, "best.pt", 13, b3(b"claimed bytes"), FileIdentity.from_path(f), 0, 1, True, 0, "")
    with open(f, "r+b"):  # a writer that kept its fd
        why, mismatch = delete_verified(f, aside, claim)
    assert why == "someone holds it open for writing" and not mismatch
    assert f.read_bytes() == b"claimed bytes" and not aside.exists()
    why, _ = delete_verified(f, aside, claim)  # nobody writes it now: deleted
    assert why == "" and not f.exists() and not aside.exists()


def test_an_interrupted_release_is_put_back_at_start_and_strangers_are_left_alone(
    tmp_path: Path, sock_dir: Path
) -> None:
    """Review 2, finding 5: a `.bw-release.N` in a watched dir crashed the sidecar at start (the
    ledger was read from a worker thread), so a box whose release was killed could never come
    back. Now its own asides go back; a file that only looks like one stays, and is reported."""
    d = make_daemon(tmp_path, sock_dir)
    d.start()
    try:
        (d.watch / "best.pt").write_bytes(b"claimed bytes")
        (d.watch / "other.pt").write_bytes(b"other bytes")
        claims = {c.path: c for c in d.wait_durable(2)}
        ids = {c.path: c.seq for c in claims.values()}
        d.kill(9)
        ledger = sqlite3.connect(d.root / "state" / "ledger.sqlite")
        claim_id = {p: i for p, i in ledger.execute("SELECT path, id FROM claims WHERE current = 1")}
        ledger.close()
        # What a release killed between its rename and its unlink leaves behind ...
        os.rename(d.watch / "best.pt", d.watch / f".bw-release.{claim_id['best.pt']}")
        # ... an aside whose bytes are not its claim's, and a stranger's file named like one.
        os.rename(d.watch / "other.pt", d.watch / f".bw-release.{claim_id['other.pt']}")
        (d.watch / f".bw-release.{claim_id['other.pt']}").write_bytes(b"rewritten")
        (d.watch / ".bw-release.999").write_bytes(b"a user's own file")
        d.start()
        assert (d.watch / "best.pt").read_bytes() == b"claimed bytes"
        assert not (d.watch / f".bw-release.{claim_id['best.pt']}").exists()
        assert (d.watch / f".bw-release.{claim_id['other.pt']}").read_bytes() == b"rewritten"
        assert (d.watch / ".bw-release.999").read_bytes() == b"a user's own file"
        pending = {p.path: p.state for p in d.listing().pending}
        assert pending[".bw-release.999"] == pb.PENDING_TEMP
        assert pending[f".bw-release.{claim_id['other.pt']}"] == pb.PENDING_TEMP
        best = next(c for c in d.claims() if c.path == "best.pt")
        assert best.seq == ids["best.pt"]  # the same claim, not a new one
    finally:
        d.kill()


def test_a_mount_inside_a_watched_dir_is_reported_not_looked_through(tmp_path: Path) -> None:
    """Review 2, finding 8: a filesystem mounted over a claimed directory hid the claimed file; its
    claim ended as "deleted" and `down` allowed while the bytes were still on the box, under it."""
    with running(tmp_path) as d:
        sub = d.watch / "sub2"
        sub.mkdir()
        (sub / "hidden.bin").write_bytes(b"under the mount")
        d.wait_durable(1)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(sub)], check=True)
        try:
            pending = wait_until(
                lambda: {p.path: p for p in d.listing().pending}.get("sub2"), what="the mount point named"
            )
            assert pending.state == pb.PENDING_UNCLAIMABLE and "mount point" in pending.detail
        finally:
            subprocess.run(["umount", str(sub)], check=True)
        assert not any(p.path == "sub2" for p in d.listing().pending)


@contextlib.contextmanager
def throttled_reads(pid: int, path: Path, bytes_per_s: int) -> Iterator[None]:
    """Hold the process's reads from the block device that holds `path` to `bytes_per_s`: a real
    cgroup v1 blkio throttle, the process moved into a group of its own and back afterwards."""
    root = Path("/sys/fs/cgroup/blkio")
    if not (root / "blkio.throttle.read_bps_device").exists():
        pytest.skip("no cgroup v1 blkio controller on this machine to slow a read with")
    home = next(
        (line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
         if line.split(":")[1] == "blkio"),
        "/",
    )  # fmt: skip
    dev = os.stat(path).st_dev
    group = root / f"boxwarden-test-{os.getpid()}-{pid}"
    group.mkdir()
    try:
        try:
            (group / "blkio.throttle.read_bps_device").write_text(
                f"{os.major(dev)}:{os.minor(dev)} {bytes_per_s}"
            )
        except OSError as exc:
            pytest.skip(f"the device of {path} cannot be throttled ({exc.strerror}): a partition or no disk")
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            (root / home.lstrip("/") / "cgroup.procs").write_text(str(pid))
        group.rmdir()


def test_a_file_sealed_while_the_release_proves_the_copies_is_never_deleted(tmp_path: Path) -> None:
    """Review 8, finding 1: the release proved the verified claims durable (which takes a while),
    then deleted every claim current by then, a file sealed meanwhile too: never pulled, perhaps
    never durable, and `down` went on. Only the claims the verified digest named are released.

    The proof is held up by the device: the sidecar's reads of it are throttled to 2 MB/s, so the
    re-read of a 16 MiB copy takes 8 s; late.bin is written once the sidecar has the copy open."""
    with running(tmp_path) as d:
        assert d.proc is not None
        sidecar = d.proc.pid
        (d.watch / "big.bin").write_bytes(os.urandom(16 << 20))
        d.wait_durable(1)
        req = pb.ReleaseArtifactsRequest(manifest_digest=d.listing().manifest_digest)
        with throttled_reads(sidecar, d.store, 2_000_000), ThreadPoolExecutor(1) as pool:
            release = pool.submit(d.stub.ReleaseArtifacts, req, timeout=120)
            copy = str(d.store / "big.bin")
            wait_until(lambda: copy in open_paths(sidecar), what="the release re-reading the copy")
            (d.watch / "late.bin").write_bytes(b"written while the release proves the copies")
            wait_until(lambda: claim_of(d, "late.bin"), what="late.bin sealed")
            assert not release.done(), "the release ended before late.bin was sealed: nothing was tested"
            resp = release.result()
        assert list(resp.deleted) == ["big.bin"]
        assert [(r.code, r.path) for r in resp.refused] == [("MANIFEST_STALE", "late.bin")]
        assert (d.watch / "late.bin").read_bytes() == b"written while the release proves the copies"


def test_the_release_re_reads_at_full_speed_whatever_the_push_rate(tmp_path: Path) -> None:
    """At 1 MB/s the proof of a 16 MiB copy would take 16 s; `down`'s release runs when no job
    does and the user waits: it lifts the rate, and ends well within its 10 s deadline."""
    with running(tmp_path, push_rate_bytes_s=1_000_000) as d:
        (d.watch / "big.bin").write_bytes(os.urandom(16 << 20))
        wait_until(lambda: claim_of(d, "big.bin"), timeout=60, what="big.bin sealed")
        assert list(d.stub.Drain(pb.DrainRequest(wait=True, timeout_s=60), timeout=90))[-1].done
        req = pb.ReleaseArtifactsRequest(manifest_digest=d.listing().manifest_digest)
        resp = d.stub.ReleaseArtifacts(req, timeout=10)
        assert (list(resp.deleted), list(resp.refused)) == (["big.bin"], [])


def test_two_names_of_one_file_are_both_released(tmp_path: Path) -> None:
    """Review 10, finding 3: unlinking the first name moved the second's ctime, and the release
    kept it as "changed since its claim" (a half-done teardown, a writer to look for that is not
    there). Its bytes decide: they are the claim's."""
    with running(tmp_path) as d:
        data = os.urandom(5000)
        (d.watch / "a.bin").write_bytes(data)
        os.link(d.watch / "a.bin", d.watch / "b.bin")
        d.wait_durable(2)
        req = pb.ReleaseArtifactsRequest(manifest_digest=d.listing().manifest_digest)
        resp = d.stub.ReleaseArtifacts(req, timeout=60)
        assert (sorted(resp.deleted), list(resp.refused), list(resp.kept)) == (["a.bin", "b.bin"], [], [])
        assert not (d.watch / "a.bin").exists() and not (d.watch / "b.bin").exists()
        assert (d.store / "b.bin").read_bytes() == data


def test_a_file_written_before_the_clock_was_stepped_back_settles_without_waiting_for_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 17 (a suspicion, confirmed here): a ctime an hour in the future (the clock was stepped
    back after the write) held a sealing slot for that hour; 64 such files stalled every seal."""
    import asyncio
    import time
    import types

    from sidecar import sealer

    f = tmp_path / "a.bin"
    f.write_bytes(b"written before the clock went back an hour")
    real = time.time_ns
    monkeypatch.setattr(sealer.time, "time_ns", lambda: real() - 3600 * 10**9)
    fake = types.SimpleNamespace(_settle_s=0.01)
    ident = asyncio.run(asyncio.wait_for(sealer.Sealer._settled(fake, f), timeout=10))  # type: ignore[arg-type]
    assert ident == sealer.identity(f)
