"""The Iron Law end to end: the real CLI against real sidecars, each test a way `down` used to allow
wrongly or lose data at 34164bb (the issue's findings), now refused or safe."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3

from tests.conftest import REPO, Bw, pid_alive, wait_until

NAME = "box1"


def codes(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(r["code"], r["path"]) for r in doc["reasons"]}


def dry(bw: Bw, name: str = NAME) -> dict[str, Any]:
    r = bw("down", name, "--dry-run", "--json")
    doc = dict(json.loads(r.stdout))
    assert r.returncode == (0 if doc["allowed"] else 3), r.stderr
    return doc


def pull_verify(bw: Bw, name: str = NAME, *extra: str) -> Path:
    pulled = bw.cwd / f"pulled-{name}"
    bw.ok("pull", name, "--to", str(pulled))
    bw.ok("verify", str(pulled), *extra)
    return pulled


def claim_digest(bw: Bw, path: str, name: str = NAME) -> str | None:
    return next((c["blake3"] for c in bw.artifacts(name)["claims"] if c["path"] == path), None)


def test_in_place_rewrite_keeping_size_and_mtime_is_never_deleted_unpulled(bw: Bw) -> None:
    p = bw.up(NAME)
    f = p["watch"] / "cell-a" / "weights.bin"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"old" * 1000)
    bw.wait_durable(NAME, 1)
    pull_verify(bw)
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.write(b"new" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    new = blake3.blake3(b"new" * 1000).hexdigest()
    wait_until(lambda: claim_digest(bw, "cell-a/weights.bin") == new, what="the rewrite to be sealed again")
    assert not dry(bw)["allowed"]  # the verified tree holds the old bytes
    r = bw("down", NAME, "--confirm", NAME)
    assert r.returncode == 3
    assert f.read_bytes() == b"new" * 1000
    pulled = pull_verify(bw)
    assert (pulled / "cell-a" / "weights.bin").read_bytes() == b"new" * 1000
    bw.wait_durable(NAME, 1)
    bw.ok("down", NAME, "--confirm", NAME)
    assert (p["durable"] / "cell-a" / "weights.bin").read_bytes() == b"new" * 1000


def test_dcp_metadata_and_hidden_files_are_pulled_not_skipped(bw: Bw) -> None:
    p = bw.up(NAME)
    ck = p["watch"] / "step-100"
    ck.mkdir()
    (ck / ".metadata").write_bytes(b"dcp plan")
    (ck / "__0_0.distcp").write_bytes(b"shard 0")
    bw.wait_durable(NAME, 2)
    pulled = pull_verify(bw)
    assert (pulled / "step-100" / ".metadata").read_bytes() == b"dcp plan"


def test_a_file_written_during_the_release_stops_the_teardown_before_the_meter(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "a.bin").write_bytes(b"first to go")
    (p["watch"] / "b.bin").write_bytes(os.urandom(1 << 20) * 64)  # time for the writer to react
    bw.wait_durable(NAME, 2)
    pull_verify(bw)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys\n"
            "a, new = sys.argv[1], sys.argv[2]\n"
            "print('ready', flush=True)\n"
            "while os.path.exists(a): pass\n"
            "open(new, 'wb').write(b'written while the release ran')\n",
            str(p["watch"] / "a.bin"),
            str(p["watch"] / "c-new.bin"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        pid = bw.sidecar_pids()[0]
        r = bw("down", NAME, "--confirm", NAME, "--json")
        assert writer.wait(timeout=60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        assert writer.stdout is not None
        writer.stdout.close()
    assert r.returncode == 3, r.stderr
    assert "c-new.bin" in r.stderr and "meter was not touched" in r.stderr
    assert (p["watch"] / "c-new.bin").read_bytes() == b"written while the release ran"
    assert pid_alive(pid)  # the sidecar keeps watching
    assert bw.json("status")["boxes"][0]["status"] == "up"


def test_reusing_a_box_name_never_overwrites_the_previous_runs_durable_copies(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "best.bin").write_bytes(b"run one")
    bw.wait_durable(NAME, 1)
    pull_verify(bw)
    bw.ok("down", NAME, "--confirm", NAME)
    first_run = p["durable"]
    assert (first_run / "best.bin").read_bytes() == b"run one"
    bw.ok("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt", "--run-id", "second")
    (p["watch"] / "best.bin").write_bytes(b"run two, other bytes")
    bw.wait_durable(NAME, 1)
    assert (first_run / "best.bin").read_bytes() == b"run one"
    assert (first_run.parent / "second" / "best.bin").read_bytes() == b"run two, other bytes"


def test_a_durable_copy_corrupted_since_its_proof_refuses_down_with_3(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "best.bin").write_bytes(b"precious")
    bw.wait_durable(NAME, 1)
    pull_verify(bw)
    doc = dry(bw)
    assert doc["allowed"] is True
    line = next(c for c in doc["checks"] if c["check"] == "every claim durable")
    assert "oldest proof at" in line["detail"] and "proves every copy again" in line["detail"]
    (p["durable"] / "best.bin").write_bytes(b"rotten!!")
    r = bw("down", NAME, "--confirm", NAME, "--json")
    assert r.returncode == 3, r.stderr
    assert "NOT_DURABLE" in r.stderr
    assert (p["watch"] / "best.bin").read_bytes() == b"precious"  # nothing deleted


def test_the_evidence_digest_is_a_digest_of_the_evidence(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "a.bin").write_bytes(b"a")
    bw.wait_durable(NAME, 1)
    pull_verify(bw)
    first, second = dry(bw), dry(bw)
    assert first["evidence_digest"] == second["evidence_digest"]  # same evidence, same digest
    (p["watch"] / "b.tmp").write_bytes(b"a save in progress")
    wait_until(lambda: not dry(bw)["allowed"], what="the temp file to be seen")
    assert dry(bw)["evidence_digest"] != first["evidence_digest"]


def test_a_sidecar_of_another_version_is_named_as_such(bw: Bw) -> None:
    bw.up(NAME)
    (pid,) = bw.sidecar_pids()
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not pid_alive(pid), what="the sidecar to stop")
    config = bw.home / "boxes" / NAME / "sidecar.json"
    code = (
        "import sys, sidecar; sidecar.__version__ = '0.0.0+other'\n"
        "from sidecar.__main__ import main\n"
        "sys.exit(main(['--config', sys.argv[1]]))\n"
    )
    env = {**bw.env, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
    other = subprocess.Popen(
        [sys.executable, "-c", code, str(config)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        doc = wait_until(
            lambda: (d := dry(bw)) and "SIDECAR_UNREACHABLE" not in {r["code"] for r in d["reasons"]} and d,
            what="the other version to answer",
        )
        assert "VERSION_MISMATCH" in {r["code"] for r in doc["reasons"]}
    finally:
        other.terminate()
        other.wait(timeout=30)


def test_long_names_go_through_the_whole_lifecycle(bw: Bw) -> None:
    p = bw.up(NAME)
    names = ["a" * 244 + ".bin", "b" * 247 + ".bin", "c" * 255]
    for n in names:
        (p["watch"] / n).write_bytes(n.encode()[:10])
    bw.wait_durable(NAME, len(names))
    pulled = pull_verify(bw)
    doc = bw.json("down", NAME, "--confirm", NAME)
    assert sorted(doc["teardown"]["deleted"]) == sorted(names)
    for n in names:
        assert (pulled / n).read_bytes() == n.encode()[:10]
        assert not (p["watch"] / n).exists()


def test_an_empty_run_can_be_closed_with_an_explicit_acknowledgment(bw: Bw) -> None:
    bw.up(NAME)
    pulled = bw.cwd / "pulled"
    bw.ok("pull", NAME, "--to", str(pulled))
    r = bw("verify", str(pulled))
    assert r.returncode == 3 and "--allow-empty" in r.stderr
    assert "NOT_VERIFIED" in {x["code"] for x in dry(bw)["reasons"]}
    bw.ok("verify", str(pulled), "--allow-empty")
    doc = dry(bw)
    assert doc["allowed"] is True, doc["reasons"]
    tree = next(c for c in doc["checks"] if c["check"] == "pulled tree re-verified")
    assert "--allow-empty" in tree["detail"]
    assert bw.json("down", NAME, "--confirm", NAME)["teardown"]["gone"] is True


def test_unclaimable_names_say_rename_it_and_never_let_down_pass(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "ok.bin").write_bytes(b"fine")
    (p["watch"] / "two\nlines.bin").write_bytes(b"newline in the name")
    (p["watch"] / "back\\slash.bin").write_bytes(b"backslash")
    bw.wait_durable(NAME, 1, pending_ok=True)
    pull_verify(bw)
    doc = dry(bw)
    found = {(r["code"], r["path"]): r["detail"] for r in doc["reasons"]}
    assert "rename it" in found[("UNCLAIMABLE", "two\nlines.bin")]
    assert "rename it" in found[("UNCLAIMABLE", "back\\slash.bin")]
    r = bw("down", NAME, "--dry-run")
    assert "two\\x0alines.bin" in r.stderr  # escaped on the terminal


def test_exclusions_are_honoured_and_shown_in_the_evidence(bw: Bw) -> None:
    p = bw.up(NAME, "--exclude", "*.log", "--exclude", "wandb/*")
    (p["watch"] / "best.bin").write_bytes(b"kept")
    (p["watch"] / "train.log").write_bytes(b"noise")
    (p["watch"] / "wandb" / "deep").mkdir(parents=True)
    (p["watch"] / "wandb" / "run.db").write_bytes(b"noise")
    # '*' crosses '/': a checkpoint deep under an excluded dir is excluded too, and named.
    (p["watch"] / "wandb" / "deep" / "best.pt").write_bytes(b"left out by the user's pattern")
    bw.wait_durable(NAME, 1)
    pull_verify(bw)
    doc = dry(bw)
    assert doc["allowed"] is True, doc["reasons"]
    line = next(c for c in doc["checks"] if c["check"] == "exclusions")
    assert (
        line["detail"]
        == "3 files excluded by *.log, wandb/* (given at up): train.log, wandb/deep/best.pt, wandb/run.db"
    )
    bw.ok("down", NAME, "--confirm", NAME)
    assert (p["watch"] / "train.log").exists() and (p["watch"] / "wandb" / "run.db").exists()


def test_two_watched_dirs_pass_the_roster_and_tear_down(bw: Bw) -> None:
    bw.ok(
        "up", NAME, "--profile", "local", "--workdir", str(bw.cwd),
        "--watch", "ckpt", "--watch", ".logs", "--roster", "cell-a", "--roster", "cell-b",
    )  # fmt: skip
    for d in ("ckpt", ".logs"):
        for cell in ("cell-a", "cell-b"):
            (bw.cwd / d / cell).mkdir(parents=True)
            (bw.cwd / d / cell / "f.bin").write_bytes(f"{d}/{cell}".encode())
    bw.wait_durable(NAME, 4)
    pulled = pull_verify(bw)
    assert (pulled / ".logs" / "cell-b" / "f.bin").read_bytes() == b".logs/cell-b"
    doc = bw.json("down", NAME, "--confirm", NAME)
    assert len(doc["teardown"]["deleted"]) == 4 and doc["teardown"]["gone"] is True


def test_pull_into_the_watched_dir_and_a_pulled_tree_inside_it_are_refused(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "best.bin").write_bytes(b"only copy outside durable")
    bw.wait_durable(NAME, 1)
    r = bw("pull", NAME, "--to", str(p["watch"]))
    assert r.returncode == 2
    doc = json.loads(bw("down", NAME, "--dry-run", "--json", "--pulled", str(p["watch"])).stdout)
    assert "EVIDENCE_OVERLAP" in {x["code"] for x in doc["reasons"]}
    assert (p["watch"] / "best.bin").exists()


def test_the_audit_record_of_a_refused_release_says_why(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "best.bin").write_bytes(b"precious")
    bw.wait_durable(NAME, 1)
    pull_verify(bw)
    (p["durable"] / "best.bin").write_bytes(b"rotten!!")
    assert bw("down", NAME, "--confirm", NAME).returncode == 3
    db = sqlite3.connect(bw.home / "state.db")
    (record,) = [json.loads(r[0]) for r in db.execute("SELECT record FROM teardowns")]
    db.close()
    assert [r["code"] for r in record["reasons"]] == ["NOT_DURABLE"]
    assert record["result"]["deleted"] == [] and record["result"]["sidecar_gone"] is False


def test_a_durable_dir_inside_the_watched_dir_is_refused_before_anything_is_created(bw: Bw) -> None:
    watch = bw.cwd / "ckpt"
    r = bw("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt",
           "--durable", (watch / "dur").as_uri())  # fmt: skip
    assert r.returncode == 2 and "overlaps" in r.stderr
    assert not (watch / "dur").exists()


def test_artifacts_shows_odd_pending_names_escaped(bw: Bw) -> None:
    p = bw.up(NAME)
    (p["watch"] / "d\nx").mkdir()
    (p["watch"] / "d\nx" / "in.bin").write_bytes(b"x")
    (p["watch"] / "t\tab.bin").write_bytes(b"y")
    wait_until(lambda: len(bw.artifacts(NAME)["pending"]) == 2, what="both names reported")
    r = bw.ok("artifacts", NAME)
    assert "d\\x0ax/in.bin" in r.stderr and "t\\x09ab.bin" in r.stderr
    assert "\t" not in r.stderr


def test_a_job_that_hands_its_work_to_a_running_tmux_server_keeps_down_refused(bw: Bw) -> None:
    """Review 2, finding 1: a job that starts its training in a tmux server that was already
    running (the server's child, with the server's environment) and exits was "not running", and
    `down` destroyed the box while the session went on to write a checkpoint."""
    sock = f"bw-{os.getpid()}-{bw.cwd.name}"[:60]
    env = {k: v for k, v in os.environ.items() if k not in ("TMUX", "TMUX_PANE")}
    # The user's own tmux server, started before the box (not in the workdir).
    subprocess.run(
        ["tmux", "-L", sock, "-f", "/dev/null", "new-session", "-d", "-s", "keep", "sleep 600"],
        cwd="/",
        env=env,
        check=True,
    )
    server = int(
        subprocess.run(
            ["tmux", "-L", sock, "display-message", "-p", "#{pid}"], env=env, capture_output=True, text=True
        ).stdout
    )
    try:
        p = bw.up(NAME)
        late = p["watch"] / "late.bin"
        bw.ok(
            "run",
            NAME,
            "--",
            "sh",
            "-c",
            f"echo early > ckpt/early.bin; unset TMUX; tmux -L {sock} new-session -d "
            f"'sleep 600; echo LATE > {late}'; exit 0",
        )
        bw.wait_durable(NAME, 1)
        pull_verify(bw)

        def stray() -> dict[str, Any] | None:
            doc = dry(bw)
            jobs = [r for r in doc["reasons"] if r["code"] == "STRAY_PROCESS"]
            return doc if any("sleep 600" in r["detail"] and "tmux" in r["detail"] for r in jobs) else None

        doc = wait_until(stray, what="the tmux session's process to be named")
        assert not doc["allowed"]
        status = bw.json("status", NAME)
        assert status["boxes"][0]["jobs_running"] == 0  # the job itself is over ...
        r = bw("down", NAME, "--confirm", NAME)
        assert r.returncode == 3, r.stdout  # ... but its work is not
        assert (p["watch"] / "early.bin").exists()
    finally:
        os.kill(server, signal.SIGKILL)  # its sessions' processes go with their terminals
    wait_until(lambda: dry(bw)["allowed"], what="down to be allowed once the session is gone")


def test_a_symlinked_watch_dir_and_reserved_watch_names_are_refused_at_up(bw: Bw) -> None:
    """Review 2, finding 4: `--watch ckpt` with `ckpt -> runs/r1` was fixed to runs/r1 at `up`;
    re-pointing the link sent new checkpoints where nobody watched, and `down` allowed."""
    (bw.cwd / "runs" / "r1").mkdir(parents=True)
    (bw.cwd / "ckpt").symlink_to("runs/r1")
    r = bw("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
    assert r.returncode == 2, r.stderr
    assert "symlink" in r.stderr and "runs/r1" in r.stderr
    for name in ("MANIFEST.json", ".bw-parts", "PULL_VERIFIED.json"):
        r = bw("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "a", "--watch", name)
        assert r.returncode == 2 and "reserved" in r.stderr, (name, r.stderr)
    assert not bw.sidecar_pids()
    bw.up(NAME, watch="runs/r1")  # the real directory is fine


def test_a_durable_dir_reached_through_a_bind_mount_of_the_watched_dir_is_refused(bw: Bw) -> None:
    """Review 2, finding 7: the overlap check compared paths, and a bind mount is another path to
    the same directory: the sidecar then sealed and copied its own copies, deeper and deeper."""
    (bw.cwd / "ckpt").mkdir()
    alias = bw.cwd.parent / f"{bw.cwd.name}-alias"
    alias.mkdir()
    subprocess.run(["mount", "--bind", str(bw.cwd), str(alias)], check=True)
    try:
        durable = alias / "ckpt" / "dur"
        r = bw("up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt",
               "--durable", durable.as_uri())  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert "overlaps" in r.stderr
        assert not (bw.cwd / "ckpt" / "dur").exists()
    finally:
        subprocess.run(["umount", str(alias)], check=True)


def test_a_process_working_in_the_workdir_holds_the_gate_job_or_not(bw: Bw) -> None:
    """Review 3, findings 1-3: the stray rule looked only at processes started after the first job,
    and only at their working directory by path. A trainer started by hand (no `run` at all), a
    shell that was there before, a working directory reached through a bind mount, or a process
    working elsewhere that holds a file in the workdir open all let `down` pass."""
    p = bw.up(NAME)
    (p["watch"] / "a.bin").write_bytes(b"a")
    bw.wait_durable(NAME, 1)
    pull_verify(bw)
    assert dry(bw)["allowed"]
    (bw.cwd / "src").mkdir()
    alias = bw.cwd.parent / f"{bw.cwd.name}-alias"
    alias.mkdir()
    subprocess.run(["mount", "--bind", str(bw.cwd), str(alias)], check=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cases = [
            ("works in", bw.cwd, ["sleep", "600"]),  # `nohup python train.py &`, by hand
            ("works in", alias / "src", ["sleep", "601"]),  # the workdir through a bind mount
            ("holds", Path("/"), ["sh", "-c", f"exec 3>>{bw.cwd / 'src' / 'stage.bin'}; exec sleep 602"]),
        ]
        for why, cwd, argv in cases:
            proc = subprocess.Popen(argv, cwd=cwd, start_new_session=True)
            procs.append(proc)

            def named(pid: int = proc.pid, why: str = why) -> bool:
                return any(
                    r["code"] == "STRAY_PROCESS" and f"pid {pid} " in r["detail"] and why in r["detail"]
                    for r in dry(bw)["reasons"]
                )

            wait_until(named, what=f"pid {proc.pid} ({why}) to hold the gate")
            proc.kill()
            proc.wait()
            wait_until(lambda: dry(bw)["allowed"], what="the gate to pass once it is gone")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", str(alias)], check=True)


def test_a_pulled_tree_that_is_a_bind_mount_of_the_watched_dir_is_refused(bw: Bw) -> None:
    """Review 3, finding 5: EVIDENCE_OVERLAP compared paths; `--pulled` through a bind mount of the
    watched dir was judged as a separate copy, and the release deleted its only bytes."""
    p = bw.up(NAME)
    (p["watch"] / "h.bin").write_bytes(b"HHHH")
    bw.wait_durable(NAME, 1)
    pull_verify(bw)
    alias = bw.cwd.parent / f"{bw.cwd.name}-pulled-alias"
    alias.mkdir()
    subprocess.run(["mount", "--bind", str(p["watch"]), str(alias)], check=True)
    try:
        r = bw("down", NAME, "--dry-run", "--json", "--pulled", str(alias))
        assert r.returncode == 3, r.stdout
        assert ("EVIDENCE_OVERLAP", str(alias)) in codes(json.loads(r.stdout))
    finally:
        subprocess.run(["umount", str(alias)], check=True)
    assert (p["watch"] / "h.bin").read_bytes() == b"HHHH"
