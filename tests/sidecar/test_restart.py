"""Restart policy: a job that dies is started again, resuming from its newest durable checkpoint
(BOXWARDEN_RESUME_FROM); a finished, stopped or out-of-restarts job is not. Real sidecar, real
jobs, the real example trainer (torch)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from tests.conftest import REPO, pid_alive, wait_until
from tests.sidecar.daemon import Daemon, running

TRAINER = REPO / "examples" / "train_tiny.py"


@contextlib.contextmanager
def job(d: Daemon, argv: list[str], **request: object) -> Iterator[pb.Job]:
    started = d.stub.StartJob(pb.StartJobRequest(argv=argv, **request), timeout=60).job  # type: ignore[arg-type]
    try:
        yield started
    finally:
        d.stub.StopJob(pb.StopJobRequest(id=started.id, grace_s=1), timeout=60)


def events(d: Daemon, kind: str, job_id: str) -> list[pb.Event]:
    return [e for e in d.events() if pb.EventKind.Name(e.kind) == kind and e.job_id == job_id]


def listed(d: Daemon, job_id: str) -> pb.Job:
    return next(j for j in d.stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs if j.id == job_id)


def test_a_killed_job_is_restarted_and_resumes_from_its_newest_durable_checkpoint(tmp_path: Path) -> None:
    with running(tmp_path / "box") as d:
        out = d.watch / "cell-a"
        out.mkdir()
        argv = [sys.executable, str(TRAINER), "--out", str(out), "--steps", "100000"]
        argv += ["--save-every", "50", "--log-every", "10", "--step-delay-s", "0.01"]
        with job(d, argv, cell="cell-a", restart="on-failure", max_restarts=2, restart_backoff_s=0.2) as j:

            def durable_steps() -> list[int]:
                return sorted(
                    int(m.group(1))
                    for c in d.claims()
                    if c.durable and (m := re.fullmatch(r"cell-a/ckpt-(\d+)\.pt", c.path))
                )

            before = wait_until(lambda: len(durable_steps()) >= 2 and durable_steps(), timeout=120)
            os.kill(listed(d, j.id).pid, signal.SIGKILL)
            exited = wait_until(lambda: events(d, "JOB_EXITED", j.id), timeout=30)
            assert exited[0].detail == "-9"
            restarted = wait_until(lambda: events(d, "JOB_RESTARTED", j.id), timeout=30)[0]
            m = re.search(r"BOXWARDEN_RESUME_FROM=(\S+)", restarted.detail)
            assert m, restarted.detail
            named = Path(m.group(1))
            step = int(re.fullmatch(r"ckpt-(\d+)\.pt", named.name).group(1))  # type: ignore[union-attr]
            assert named.parent == out and step >= before[-1]
            assert step in durable_steps()  # it names a durable checkpoint
            again = wait_until(
                lambda: (x := listed(d, j.id)).state == pb.JOB_STATE_RUNNING and x.restarts and x
            )
            assert again.restarts == 1 and again.restart == "on-failure" and again.max_restarts == 2
            log = Path(again.log_path)
            wait_until(lambda: f"resumed from {named.name} at step {step}" in log.read_text(), timeout=60)


def test_a_job_that_keeps_failing_stops_being_restarted_at_its_maximum(tmp_path: Path) -> None:
    with running(tmp_path / "box") as d:
        argv = ["sh", "-c", "echo run; exit 3"]
        with job(d, argv, restart="on-failure", max_restarts=2, restart_backoff_s=0.05) as j:
            wait_until(lambda: len(events(d, "JOB_EXITED", j.id)) == 3, timeout=30)
            done = wait_until(lambda: (x := listed(d, j.id)).state == pb.JOB_STATE_EXITED and x, timeout=10)
            assert done.restarts == 2 and done.exit_code == 3
            assert [e.detail.split(";")[0] for e in events(d, "JOB_RESTARTED", j.id)] == [
                "attempt 1 of 2 after exit 3",
                "attempt 2 of 2 after exit 3",
            ]
            assert (
                "BOXWARDEN_RESUME_FROM unset" in events(d, "JOB_RESTARTED", j.id)[0].detail
            )  # no checkpoint
            # Three more health samples: still three runs.
            seq = d.events()[-1].seq
            snap = next(iter(d.stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=5)))
            wait_until(
                lambda: (
                    next(iter(d.stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=5))).at_unix_ns
                    > snap.at_unix_ns + 600_000_000
                )
            )
            assert len(events(d, "JOB_EXITED", j.id)) == 3 and d.events()[-1].seq >= seq


def test_a_clean_exit_a_never_policy_and_a_stop_start_nothing_again(tmp_path: Path) -> None:
    with running(tmp_path / "box") as d:
        with job(d, ["sh", "-c", "exit 0"], restart="on-failure", restart_backoff_s=0.05) as ok:
            wait_until(lambda: events(d, "JOB_EXITED", ok.id))
        with job(d, ["sh", "-c", "exit 1"]) as never:
            wait_until(lambda: events(d, "JOB_EXITED", never.id))
        with job(d, ["sh", "-c", "exit 1"], restart="on-failure", restart_backoff_s=1.0) as stopped:
            wait_until(lambda: events(d, "JOB_EXITED", stopped.id))
        # `job` stopped it during its backoff; the backoff ends and more samples pass.
        snap = next(iter(d.stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=5)))
        wait_until(
            lambda: (
                next(iter(d.stub.WatchHealth(pb.WatchHealthRequest(once=True), timeout=5))).at_unix_ns
                > snap.at_unix_ns + 1_500_000_000
            ),
            timeout=15,
        )
        for j in (ok, never, stopped):
            assert events(d, "JOB_RESTARTED", j.id) == []
            assert len(events(d, "JOB_EXITED", j.id)) == 1


def test_an_unknown_restart_policy_is_refused(tmp_path: Path) -> None:
    with running(tmp_path / "box") as d:
        with pytest.raises(grpc.RpcError) as e:
            d.stub.StartJob(pb.StartJobRequest(argv=["true"], restart="always"), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "on-failure" in (e.value.details() or "")


def test_a_release_is_refused_while_a_failed_job_waits_to_be_started_again(tmp_path: Path) -> None:
    with running(tmp_path / "box") as d:
        with job(d, ["sh", "-c", "exit 1"], restart="on-failure", restart_backoff_s=30.0) as j:
            wait_until(lambda: events(d, "JOB_EXITED", j.id))
            r = d.stub.ReleaseArtifacts(pb.ReleaseArtifactsRequest(manifest_digest="0" * 64), timeout=30)
            held = [x.detail for x in r.refused if x.code == "JOB_RUNNING"]
            assert held == [f"job {j.id} (failed; waiting to be started again)"]
            assert not r.deleted
        # StopJob (leaving `job`) cancelled the restart: nothing holds the release for that job now.
        r = d.stub.ReleaseArtifacts(pb.ReleaseArtifactsRequest(manifest_digest="0" * 64), timeout=30)
        assert not [x for x in r.refused if x.code == "JOB_RUNNING"]


def test_a_job_without_a_cell_resumes_only_from_what_lies_in_its_own_working_directory(
    tmp_path: Path,
) -> None:
    with running(tmp_path / "box") as d:
        other = d.watch / "other-job"
        other.mkdir()
        (other / "ckpt-000100.pt").write_bytes(b"PK\x03\x04" + os.urandom(100))  # another job's checkpoint
        d.wait_durable(1)
        argv = ["sh", "-c", 'echo "resume=${BOXWARDEN_RESUME_FROM:-none}"; exit 1']
        with job(d, argv, restart="on-failure", max_restarts=1, restart_backoff_s=0.05) as j:
            restarted = wait_until(lambda: events(d, "JOB_RESTARTED", j.id))[0]
            assert "BOXWARDEN_RESUME_FROM unset" in restarted.detail
            log = Path(listed(d, j.id).log_path)
            wait_until(lambda: log.read_text().count("resume=none") == 2)


def test_another_process_with_the_same_command_line_is_never_taken_for_the_job(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(600)", "same-argv"]
    twin: subprocess.Popen[bytes] | None = None
    with running(tmp_path / "box") as d:
        try:
            with job(d, argv, restart="on-failure", max_restarts=1, restart_backoff_s=0.05) as j:
                # The twin: the very same command line, started by someone else in the job's workdir.
                twin = subprocess.Popen(argv, cwd=listed(d, j.id).cwd, stdin=subprocess.DEVNULL)
                wait_until(lambda: pid_alive(twin.pid))
                listing = d.stub.ListJobs(pb.ListJobsRequest(), timeout=30)
                (mine,) = [x for x in listing.jobs if x.id == j.id]
                assert twin.pid not in mine.live_pids and mine.pid in mine.live_pids
                assert twin.pid in [s.pid for s in listing.strays]  # seen, as what it is: a stray
                # The job's own process dies: the job died (its signal), however alike the twin is,
                # and on-failure starts it again.
                os.kill(mine.pid, signal.SIGKILL)
                assert wait_until(lambda: events(d, "JOB_EXITED", j.id))[0].detail == "-9"
                again = wait_until(lambda: (x := listed(d, j.id)).restarts == 1 and x.pid != mine.pid and x)
                assert twin.pid not in again.live_pids
            # StopJob (leaving `job`) ended the job's processes, and never the twin.
            assert listed(d, j.id).state == pb.JOB_STATE_STOPPED and twin.poll() is None
        finally:
            if twin is not None:
                twin.kill()
                twin.wait(timeout=30)
