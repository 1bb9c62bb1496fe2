"""Issue 25: the controller knows who answers. Boxes over the real sshd on 127.0.0.1 (two box users,
two controllers with their own state homes) and moto's real S3 server.

- Two boxes on one host whose names share their first 50 characters each get a socket of their own
  (never a cut of the name), each command talks to its own sidecar, and a killed sidecar makes its
  box unreachable, never judged on the other's evidence (finding 1).
- A sidecar that answers with another box's, run's or start's identity is refused
  (SIDECAR_MISMATCH, exit 3), and `up` waits for the sidecar it started itself (finding 1).
- A second controller does not adopt a sidecar it did not start, unless it says `--adopt`, which
  takes the run and the store from the sidecar (finding 2).
- `up --durable-credentials NEW` on a running box restarts its sidecar with them (finding 4).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from controller.bootstrap import socket_path_for
from tests.conftest import Bw, pid_alive, save_weights, wait_until
from tests.s3server import S3Server, write_credentials
from tests.sshbox import Box
from tests.test_remote_e2e import (  # noqa: F401 - fixtures
    Remote,
    _control_paths,
    _exit_master,
    owner_of,
    remote,
    venv_template,
    wheel_cache,
    write_as_box,
)

BASE = "ablation-sweep-lr3e-4-wd0.1-bs256-warmup500-seed42x"  # 50 characters
C, D = BASE + "-node-0001", BASE + "-node-0002"  # 60 each: equal but for their last character


def up_as(rem: Remote, box: Box, name: str, *extra: str, bw: Bw | None = None, code: int = 0) -> Any:
    """`up NAME --host <box>`: a box name of its own on the box's host (its venv from the session's
    template: these tests are not about the install)."""
    with rem.seeding(box) as seeded:
        if not seeded:  # no template yet: this `up` installs it, and offers it to the others
            r = _up_as(rem, box, name, *extra, bw=bw)
            rem.template.offer(box)
    if seeded:
        r = _up_as(rem, box, name, *extra, bw=bw)
    assert r.returncode == code, f"up {name} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout) if code == 0 else r


def _up_as(
    rem: Remote, box: Box, name: str, *extra: str, bw: Bw | None = None
) -> subprocess.CompletedProcess[str]:
    more = ("--instance-id", f"i-{name[-4:]}", *extra)
    rem.running(more)  # (an instance the provider lists)
    return (bw or rem.bw)(
        "up", name, "--profile-file", str(rem.profile), "--host", box.alias, *more, "--json", timeout=300
    )  # fmt: skip


def bucket_box(rem: Remote, s3: S3Server, name: str, creds: Path) -> tuple[Box, dict[str, Any]]:
    """A remote box that pushes to a bucket of moto's with these credentials (its venv seeded)."""
    box = rem.boxes(name)
    url = s3.url(s3.bucket(), "ck")
    return box, rem.up(box, "--durable", url, "--durable-credentials", str(creds), seeded=True)


def second_controller(rem: Remote, tmp_path: Path) -> Bw:
    """Another controller (its own state home) reaching the same boxes through the same ssh_config."""
    other = Bw(tmp_path / "home2", rem.bw.cwd)
    keys = ("BOXWARDEN_SSH_CONFIG", "BOXWARDEN_WHEELHOUSE", "FAKE_PROVIDER_STATE")
    other.env.update({k: rem.bw.env[k] for k in keys})
    return other


def codes(r: subprocess.CompletedProcess[str]) -> set[str]:
    return {x["code"] for x in json.loads(r.stdout)["reasons"]}


def test_two_boxes_whose_names_share_50_characters_each_talk_to_their_own_sidecar(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    box = remote.boxes("h1")
    remote.profile.write_text(remote.profile.read_text().replace('path = "~"', 'path = "~/persist"'))
    assert box.run_as_box(["mkdir", "-p", str(box.home / "persist")]).returncode == 0
    bw = remote.bw
    # The first `up` installs the venv for real (on the durable tier): the second finds it.
    first = {n: up_as(remote, box, n, "--watch", f"ckpt-{n[-1]}", "--state-on-durable") for n in (C, D)}
    assert first[C]["pid"] != first[D]["pid"] and first[C]["started"] and first[D]["started"]
    socks = sorted((box.home / ".boxwarden" / "s").glob("*.sock"))
    assert len(socks) == 2  # one each, named by a digest of the box's whole state path

    # A fan-out over both: each box's cell runs on its own sidecar.
    cell = (
        "import os, pathlib; p = pathlib.Path(os.environ['OUT']); p.parent.mkdir(); "
        "p.write_text(os.environ['BOXWARDEN_CELL'])"
    )
    plan = tmp_path / "plan.toml"
    text = f'name = "sw"\n[defaults]\ncommand = {json.dumps(["python3", "-c", cell])}\n\n'
    for n in (C, D):
        text += f'[[box]]\nname = "{n}"\nprofile_file = "{remote.profile}"\nhost = "h1"\n'
        text += f'instance_id = "i-{n[-4:]}"\nwatch = ["ckpt-{n[-1]}"]\n\n'
    for n in (C, D):
        out = box.home / f"ckpt-{n[-1]}" / f"cell{n[-1]}" / f"from-{n[-1]}.txt"
        text += f'[[cell]]\nname = "cell{n[-1]}"\nbox = "{n}"\nenv = {{ OUT = "{out}" }}\n\n'
    plan.write_text(text)
    doc = bw.json("fanout", "up", str(plan), "--trust-plan")  # its profile file is the test's own
    assert {b["box"]: b["cells"] for b in doc["boxes"]} == {C: ["cell1"], D: ["cell2"]}
    for n in (C, D):
        assert bw("queue", n, "sw", "--wait", "--timeout", "120", timeout=180).returncode == 0
    for n in (C, D):
        claims = bw.wait_durable(n, 1)["claims"]
        assert [c["path"] for c in claims] == [f"cell{n[-1]}/from-{n[-1]}.txt"]  # its own only
    rows = {r["box"]: r for r in bw.json("status")["boxes"]}
    assert rows[C]["sidecar"]["pid"] == first[C]["pid"] and rows[D]["sidecar"]["pid"] == first[D]["pid"]

    os.kill(first[C]["pid"], signal.SIGKILL)  # one sidecar dies: its box, and only its box, is unreachable
    wait_until(lambda: not pid_alive(first[C]["pid"]), what="C's sidecar gone")
    rows = {r["box"]: r for r in bw.json("status")["boxes"]}
    assert rows[C]["unreachable"] is True and rows[D]["unreachable"] is False
    r = bw("artifacts", C, "--json")
    assert r.returncode != 0 and "from-2.txt" not in r.stdout + r.stderr
    r = bw("down", C, "--confirm", C, "--dry-run", "--json", timeout=120)
    assert r.returncode == 3 and "SIDECAR_UNREACHABLE" in codes(r), r.stdout
    assert json.loads(r.stdout)["manifest_digest"] == ""  # no other box's claims judged
    assert pid_alive(first[D]["pid"])  # nothing was done to the other box
    again = up_as(remote, box, C, "--watch", "ckpt-1")  # its record brings it back on its own socket
    assert again["started"] is True and again["run_id"] == bw.record(C)["run_id"]
    assert [c["path"] for c in bw.artifacts(C)["claims"]] == ["cell1/from-1.txt"]


def test_an_answer_from_another_sidecar_is_refused_as_a_mismatch(bw: Bw, tmp_path: Path) -> None:
    a = bw.up("ida")
    bw.up("idb", watch="ckpt-b")
    rec_a, rec_b = bw.record("ida"), bw.record("idb")
    # Box ida's socket now leads to idb's sidecar (what two boxes sharing a socket did).
    os.unlink(rec_a["socket"])
    os.symlink(rec_b["socket"], rec_a["socket"])
    for args in (("artifacts", "ida"), ("status", "ida"), ("pull", "ida", "--to", str(tmp_path / "p"))):
        r = bw(*args, "--json")
        assert "SIDECAR_MISMATCH" in r.stdout + r.stderr or "not the one of ida" in r.stdout + r.stderr, args
        assert r.returncode != 0 or args[0] == "status", (args, r.stdout, r.stderr)
    r = bw("down", "ida", "--confirm", "ida", "--json")
    assert r.returncode == 3 and "SIDECAR_MISMATCH" in codes(r)
    shown = bw.ok("watch", "ida", "idb", "--once")
    assert "SIDECAR_MISMATCH" in shown.stdout + shown.stderr  # never shown as merely out of reach
    assert rec_b["sidecar_pid"] in bw.sidecar_pids() and pid_alive(rec_b["sidecar_pid"])  # idb untouched
    assert (a["watch"]).exists()


def test_up_refuses_a_sidecar_it_did_not_start_and_adopt_takes_its_run_and_store(
    remote: Remote,  # noqa: F811
    s3: S3Server,
    tmp_path: Path,
) -> None:
    box, first = bucket_box(remote, s3, "ad1", write_credentials(tmp_path / "creds"))
    run = remote.bw.record("ad1")["run_id"]
    other = second_controller(remote, tmp_path)
    try:
        r = up_as(remote, box, "ad1", "--watch", "ckpt", bw=other, code=3)
        assert "this controller did not start" in r.stderr and "--adopt" in r.stderr
        assert "s3://" in r.stderr  # what the running sidecar really pushes to
        assert other("status", "ad1").returncode != 0  # nothing recorded
        r = up_as(remote, box, "ad1", "--adopt", "--watch", "ckpt", bw=other, code=2)
        assert "leave out --watch" in r.stderr
        doc = up_as(remote, box, "ad1", "--adopt", bw=other)
        assert doc["started"] is False and doc["pid"] == first["pid"]
        assert doc["run_id"] == run and doc["durable"].startswith("s3://")
        rec = other.record("ad1")
        assert rec["durable_credentials"] is True and rec["run_id"] == run  # its down forgets them
        write_as_box(box, "ckpt/a.bin", "weights")
        other.wait_durable("ad1", 1, timeout=60)
        pulled = other.cwd / "pulled-adopted"
        other.ok("pull", "ad1", "--to", str(pulled))
        manifest = json.loads((pulled / "MANIFEST.json").read_text())
        assert manifest["run_id"] == run  # never a run id that does not exist
    finally:
        _exit_master(other, box)


def test_new_credentials_restart_a_running_sidecar_with_them(
    remote: Remote,  # noqa: F811
    s3: S3Server,
    tmp_path: Path,
) -> None:
    old = write_credentials(tmp_path / "old")
    box, first = bucket_box(remote, s3, "cr1", old)
    on_box = box.home / ".boxwarden" / "boxes" / "cr1" / "sidecar" / "durable-credentials"
    same = remote.up(box, "--durable-credentials", str(old))
    assert same["started"] is False and same["pid"] == first["pid"]  # the same ones: left alone
    new = tmp_path / "new"
    new.write_text(old.read_text().replace("[default]", "[default]\n# rotated"))
    new.chmod(0o600)
    again = remote.up(box, "--durable-credentials", str(new))
    assert again["started"] is True and again["pid"] != first["pid"]
    assert any("credentials" in x for x in again["restarted_for"])
    assert on_box.read_text() == new.read_text()
    write_as_box(box, "ckpt/b.bin", "more")
    remote.bw.wait_durable("cr1", 1, timeout=60)  # pushes go on with the new ones


def test_up_never_takes_a_socket_that_answers(bw: Bw) -> None:
    """Something answers where the box's sidecar must listen (another box's sidecar, of a version
    that holds no lock): the new sidecar does not start, and the other keeps its socket."""
    path = socket_path_for(bw.home / "boxes" / "sk1")  # where `up` will put it
    path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))
    other.listen(4)
    try:
        r = bw("up", "sk1", "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
        assert r.returncode == 1 and "answers on the socket" in r.stderr, r.stderr
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(path))  # still the other's, still answering
        probe.close()
        assert bw("status", "sk1").returncode != 0  # nothing recorded
    finally:
        other.close()


def test_a_follower_goes_on_with_the_sidecar_up_restarted(bw: Bw, tmp_path: Path) -> None:
    """`events -f` takes answers only from the box's sidecar: after `up` restarted it (new health
    settings, so a new start nonce), the record names the new one and the follower goes on."""
    p = bw.up("fw1")
    out = (tmp_path / "events.jsonl").open("w")
    follower = subprocess.Popen(
        [sys.executable, "-m", "controller", "events", "fw1", "-f", "--json"],
        cwd=bw.cwd, env=bw.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        first = bw.record("fw1")["sidecar_pid"]
        wait_until(lambda: "SIDECAR_STARTED" in (tmp_path / "events.jsonl").read_text(), what="the journal")
        bw.ok(
            "up",
            "fw1",
            "--profile",
            "local",
            "--workdir",
            str(bw.cwd),
            "--watch",
            "ckpt",
            "--stall-minutes",
            "5",
        )
        assert bw.record("fw1")["sidecar_pid"] != first  # restarted: another start, another nonce
        save_weights(p["watch"] / "cell-a" / "w.safetensors", seed=3)
        wait_until(
            lambda: "cell-a/w.safetensors" in (tmp_path / "events.jsonl").read_text(),
            what="the new sidecar's events followed",
        )
        assert follower.poll() is None
    finally:
        follower.terminate()
        follower.wait(timeout=30)
        out.close()


def test_a_refused_up_to_one_host_leaves_no_link_that_a_later_up_to_another_takes(
    remote: Remote,  # noqa: F811
) -> None:
    """Review of issue 25: the ControlMaster was named by the box alone, so after a refused
    `up X --host h1` the corrected `up X --host h2` went through the master to h1, started the
    sidecar there and recorded h2; `down X` then released h1's files and destroyed h2."""
    bw = remote.bw
    h1, h2 = remote.boxes("h1"), remote.boxes("h2")
    r = up_as(remote, h1, "xbox", "--watch", "ckpt", "--durable", "file:///nonexistent/vol/x", code=2)
    assert "mount the durable volume" in r.stderr
    up_as(remote, h2, "xbox", "--watch", "ckpt")
    assert (h2.home / ".boxwarden" / "boxes" / "xbox" / "sidecar.json").exists()
    assert not (h1.home / ".boxwarden" / "boxes" / "xbox").exists()
    pid = bw.record("xbox")["sidecar_pid"]
    assert owner_of(pid) == h2.uid  # the sidecar runs on h2, as the record says
    write_as_box(h2, "ckpt/h2.bin", "the run the user means")
    assert [c["path"] for c in bw.wait_durable("xbox", 1)["claims"]] == ["h2.bin"]
    # Its state cannot move to the durable tier while it lives (a second, empty ledger, review).
    r = up_as(remote, h2, "xbox", "--watch", "ckpt", "--state-on-durable", code=2)
    assert "before moving its state" in r.stderr


def test_the_meter_of_an_instance_two_boxes_share_stops_with_the_last_of_them(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Review of issue 25: two boxes on one instance (one host, one instance id): `down` of the
    first sent the instance's meter stop while the second still ran there, unpulled."""
    bw = remote.bw
    box = remote.boxes("h1")
    remote.provider("create", "i-h1", "--linger", "1")
    for n in ("boxc", "boxd"):
        r = bw("up", n, "--profile-file", str(remote.profile), "--host", "h1", "--instance-id", "i-h1",
               "--workdir", f"~/{n}", "--watch", "ckpt", "--json", timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
    for n in ("boxc", "boxd"):
        write_as_box(box, f"{n}/ckpt/{n}.bin", f"{n}'s weights")
        bw.wait_durable(n, 1)
        bw.ok("pull", n, "--to", str(bw.cwd / f"p-{n}"))
        bw.ok("verify", str(bw.cwd / f"p-{n}"))

    bw.json("down", "--all", "--dry-run")  # a dry run over the fleet leaves no login behind either
    assert not [cm for cm in _control_paths(bw) if cm.exists()]

    def deletes() -> int:
        calls = json.loads((tmp_path / "provider.json").read_text())["calls"]
        return sum(1 for verb, _ in calls if verb == "delete")

    r = bw("down", "boxc", "--confirm", "boxc", "--json")
    assert r.returncode == 3 and "METER_HELD" in r.stderr and deletes() == 0, r.stderr
    assert "meter of boxc was NOT stopped" in r.stderr and "boxd" in r.stderr
    # Sixth review: the held box was called down although nothing might ever send its stop; it is
    # unfinished until a stop of its instance is proven, and `status` says so.
    rows = {r["box"]: r for r in bw.json("status")["boxes"]}
    assert rows["boxc"]["status"] == "meter-unproven" and rows["boxd"]["unreachable"] is False  # boxd runs on
    r = bw("down", "boxc", "--confirm", "boxc", "--json")  # asked again: boxd still there, still held
    assert r.returncode == 3 and "METER_HELD" in r.stderr and deletes() == 0, r.stderr
    doc = bw.json("down", "boxd", "--confirm", "boxd")  # the last box on the instance stops its meter
    assert doc["teardown"]["gone"] is True and doc["teardown"]["meter"]["sent"] is True and deletes() == 1
    rows = {r["box"]: r for r in bw.json("status")["boxes"]}
    assert rows["boxc"]["status"] == "down"  # down with it: the instance's stop is proven


def test_a_dead_sidecar_of_another_controller_is_taken_over_only_with_adopt(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Review of issue 25: a second controller's `up` of a box whose sidecar had died started a new
    run on the first one's ledger, silently (its claims, its jobs); now only `--adopt` takes it over,
    starting it again with the run and store it had."""
    box = remote.boxes("dd1")
    first = remote.up(box, seeded=True)
    run = remote.bw.record("dd1")["run_id"]
    write_as_box(box, "ckpt/a.bin", "A's weights")
    remote.bw.wait_durable("dd1", 1)
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(first["pid"]), what="the sidecar gone")
    other = second_controller(remote, tmp_path)
    try:
        r = up_as(remote, box, "dd1", "--watch", "ckpt", bw=other, code=3)
        assert f"holds run {run}" in r.stderr and "--adopt" in r.stderr, r.stderr
        # Asking for the same run id is no claim to it (second review): only --adopt takes it over.
        r = up_as(remote, box, "dd1", "--watch", "ckpt", "--run-id", run, bw=other, code=3)
        assert f"holds run {run}" in r.stderr, r.stderr
        assert other("status", "dd1").returncode != 0  # nothing recorded, nothing started
        doc = up_as(remote, box, "dd1", "--adopt", bw=other)
        assert doc["started"] is True and doc["run_id"] == run
        assert [c["path"] for c in other.wait_durable("dd1", 1)["claims"]] == ["a.bin"]
    finally:
        _exit_master(other, box)


def test_a_follower_of_one_run_ends_when_the_box_is_brought_up_as_another(bw: Bw, tmp_path: Path) -> None:
    """Review of issue 25: `events -f` followed the box across `down` and a new `up`, and kept the
    new run's events as the old run's."""
    p = bw.up("ev1")
    save_weights(p["watch"] / "cell-a" / "a.safetensors", seed=1)
    bw.wait_durable("ev1", 1)
    first = bw.record("ev1")["run_id"]
    log = tmp_path / "follow.out"
    with log.open("w") as out:
        follower = subprocess.Popen(
            [sys.executable, "-m", "controller", "events", "ev1", "-f", "--json"],
            cwd=bw.cwd, env=bw.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_until(lambda: "ARTIFACT_DURABLE" in log.read_text(), what="the follower caught up")
            bw.ok("pull", "ev1", "--to", str(tmp_path / "pulled"))
            bw.ok("verify", str(tmp_path / "pulled"))
            bw.ok("down", "ev1", "--confirm", "ev1")
            bw.ok("up", "ev1", "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
            assert follower.wait(timeout=60) == 1
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
    said = log.read_text()
    second = bw.record("ev1")["run_id"]
    assert second != first and f"the events of run {first} end here" in said
    db = sqlite3.connect(bw.home / "state.db")
    try:
        kept = [r[0] for r in db.execute("SELECT record FROM events WHERE run_id = ?", (first,))]
    finally:
        db.close()
    new_pid = bw.record("ev1")["sidecar_pid"]
    assert kept and not [r for r in kept if f"pid {new_pid}" in r]  # nothing of the new run's sidecar


def test_an_up_that_fails_leaves_no_credentials_behind(bw: Bw, s3: S3Server, tmp_path: Path) -> None:
    """Review of issue 25: `up --durable-credentials` whose sidecar could not start (no such bucket)
    left the keys on the box, and no record whose `down` would remove them."""
    creds = write_credentials(tmp_path / "creds")
    r = bw("up", "cf1", "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt", "--durable",
           s3.url("no-such-bucket-xyz", "ck"), "--durable-credentials", str(creds))  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert not list((bw.home / "boxes").rglob("durable-credentials"))
    assert bw("status", "cf1").returncode != 0


def test_the_meter_waits_for_another_controllers_box_on_the_instance(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Second review of issue 25: another controller's box on the same instance is in none of this
    controller's records; the box itself says whose sidecars run there before a meter stop. Third
    and fourth reviews: a box whose state lives in another root (a durable tier of another profile)
    was not seen, nor one whose sidecar had stopped (killed, or cleanly) with its run never torn
    down."""
    a = remote.bw
    box = remote.boxes("h1")
    remote.profile.write_text(remote.profile.read_text().replace('path = "~"', 'path = "~/persist"'))
    (tmp_path / "theirs").mkdir()
    theirs = tmp_path / "theirs" / remote.profile.name  # the other controller's copy, its tier elsewhere
    theirs.write_text(remote.profile.read_text().replace('path = "~/persist"', 'path = "~/other"'))
    assert box.run_as_box(["mkdir", "-p", str(box.home / "persist"), str(box.home / "other")]).returncode == 0
    ba = up_as(remote, box, "ba", "--workdir", "~/ba", "--watch", "ckpt", "--state-on-durable")
    b = second_controller(remote, tmp_path)
    try:
        b.ok("up", "bb", "--profile-file", str(theirs), "--host", box.alias, "--instance-id", "i-ba",
             "--workdir", "~/bb", "--watch", "ckpt")  # fmt: skip
        write_as_box(box, "ba/ckpt/a.bin", "A's weights, never pulled")
        a.wait_durable("ba", 1)
        os.kill(ba["pid"], signal.SIGTERM)  # ba's sidecar stops, cleanly; its run is not over
        wait_until(lambda: not pid_alive(ba["pid"]), what="ba's sidecar to end")
        write_as_box(box, "bb/ckpt/b.bin", "B's weights")
        b.wait_durable("bb", 1)
        b.ok("pull", "bb", "--to", str(b.cwd / "pb"))
        b.ok("verify", str(b.cwd / "pb"))
        r = b("down", "bb", "--confirm", "bb", "--json")
        assert r.returncode == 3 and "METER_HELD" in r.stderr, r.stderr
        held = r.stderr[r.stderr.index("ba (run ") :]
        assert "never torn down" in held and "/persist/.boxwarden/boxes/ba" in held, held
        calls = json.loads((tmp_path / "provider.json").read_text())["calls"]
        assert not [c for c in calls if c[0] == "delete"], calls  # no stop was sent
        # ba back, pulled and down: bb's run is over (its teardown closed it on the box), so ba's
        # down is the last on the instance and stops it.
        up_as(remote, box, "ba", "--workdir", "~/ba", "--watch", "ckpt", "--state-on-durable")
        a.ok("pull", "ba", "--to", str(a.cwd / "pa"))
        a.ok("verify", str(a.cwd / "pa"))
        meter = a.json("down", "ba", "--confirm", "ba")["teardown"]["meter"]
        assert meter["shared_with"] == [] and meter["sent"] is True, meter
        # Sixth review: bb was called down on a stop that only another controller would send; it
        # stayed unfinished, and its `down` again finds the instance gone.
        assert b.json("status", "bb")["boxes"][0]["status"] == "meter-unproven"
        _exit_master(b, box)
        from tests.sshbox import free_port
        from tests.test_box_gone_e2e import point_at

        point_at(box, free_port())  # the instance is gone, and its host with it
        doc = b.json("down", "bb", "--confirm", "bb")
        assert doc["teardown"]["gone"] is True and doc["teardown"]["meter"]["gone"] is True, doc
    finally:
        _exit_master(b, box)


def test_a_stop_sent_again_waits_for_another_controllers_box_on_the_instance(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Fourth review of issue 25: a teardown whose stop did not take is continued without a gate
    (`--resend-stop`); it asked only this controller's records, and deleted the instance under
    another controller's box brought up there since."""
    a = remote.bw
    box = remote.boxes("h1")
    remote.provider("create", "i-ba", "--stuck")
    remote.profile.write_text(remote.profile.read_text().replace("timeout_s = 30", "timeout_s = 1"))
    up_as(remote, box, "ba", "--workdir", "~/ba", "--watch", "ckpt")  # (instance i-ba)
    write_as_box(box, "ba/ckpt/a.bin", "A's weights")
    a.wait_durable("ba", 1)
    a.ok("pull", "ba", "--to", str(a.cwd / "pa"))
    a.ok("verify", str(a.cwd / "pa"))
    assert a("down", "ba", "--confirm", "ba", timeout=180).returncode == 1  # sent, never proven
    b = second_controller(remote, tmp_path)
    try:
        up_as(remote, box, "bb", "--workdir", "~/bb", "--watch", "ckpt", bw=b)
        before = len(json.loads((tmp_path / "provider.json").read_text())["calls"])
        r = a("down", "ba", "--confirm", "ba", "--resend-stop", "--json", timeout=180)
        assert r.returncode != 0 and "bb (its sidecar runs" in r.stderr, r.stderr
        calls = json.loads((tmp_path / "provider.json").read_text())["calls"][before:]
        assert ["delete", "i-ba"] not in calls, calls
        # Fifth review: a login the host refuses is no host gone: the stop is held all the same.
        _exit_master(a, box)
        _exit_master(b, box)
        key = box.sshd.client_key
        os.rename(key, f"{key}.away")
        try:
            r = a("down", "ba", "--confirm", "ba", "--resend-stop", "--json", timeout=180)
        finally:
            os.rename(f"{key}.away", key)
        assert r.returncode != 0 and "the host answers" in r.stderr, r.stderr
        calls = json.loads((tmp_path / "provider.json").read_text())["calls"][before:]
        assert ["delete", "i-ba"] not in calls, calls
        # Sixth review: this machine's own network down is no host gone either: it cannot tell.
        _exit_master(a, box)
        cli = [sys.executable, "-m", "controller", "down", "ba", "--confirm", "ba", "--resend-stop", "--json"]
        r = subprocess.run(["unshare", "-n", *cli], env=a.env, cwd=a.cwd, capture_output=True, text=True,
                           timeout=180)  # fmt: skip
        assert r.returncode == 3 and "this machine cannot tell whether the host is there" in r.stderr, (
            r.stderr
        )
        calls = json.loads((tmp_path / "provider.json").read_text())["calls"][before:]
        assert ["delete", "i-ba"] not in calls, calls
    finally:
        _exit_master(b, box)


def test_a_torn_down_run_is_over_for_every_controller(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Third review of issue 25: another controller's `up --adopt` revived a run this one had torn
    down (and pushed over its proven copies); and after runs on two hosts, this controller's own
    `up` on the first host again was refused for a run it had started itself, with no way out."""
    a = remote.bw
    h1, h2 = remote.boxes("h1"), remote.boxes("h2")

    def run_and_down(box: Box, run: str) -> None:
        remote.running(("--instance-id", f"i-{run}"))
        a.ok("up", "gpu", "--profile-file", str(remote.profile), "--host", box.alias, "--instance-id",
             f"i-{run}", "--watch", "ckpt", "--run-id", run)  # fmt: skip
        write_as_box(box, f"ckpt/{run}.bin", run)
        a.wait_durable("gpu", 1, pending_ok=True)
        a.ok("pull", "gpu", "--to", str(a.cwd / f"p-{run}"))
        a.ok("verify", str(a.cwd / f"p-{run}"))
        a.ok("down", "gpu", "--confirm", "gpu", "--pulled", str(a.cwd / f"p-{run}"))

    run_and_down(h1, "R1")
    b = second_controller(remote, tmp_path)
    try:
        r = b("up", "gpu", "--profile-file", str(remote.profile), "--host", "h1", "--instance-id", "i-R1",
              "--adopt", "--json", timeout=300)  # fmt: skip
        said = " ".join(r.stderr.split())
        assert r.returncode == 2 and "run R1 of gpu on h1 was torn down" in said, r.stderr
        # Nothing in this root: it may be in the other one (it said "none ran there" of a live one).
        r = b("up", "gpu9", "--profile-file", str(remote.profile), "--host", "h1", "--instance-id", "i-9",
              "--adopt", timeout=300)  # fmt: skip
        assert r.returncode == 2 and "add --state-on-durable" in " ".join(r.stderr.split()), r.stderr
    finally:
        _exit_master(b, h1)
    run_and_down(h2, "R2")
    remote.running(("--instance-id", "i-R3"))
    a.ok("up", "gpu", "--profile-file", str(remote.profile), "--host", "h1", "--instance-id", "i-R3",
         "--watch", "ckpt", "--run-id", "R3")  # fmt: skip
    assert a.record("gpu")["run_id"] == "R3"


def test_a_new_runs_journal_holds_none_of_the_last_runs_events(bw: Bw, tmp_path: Path) -> None:
    """Second review of issue 25: the box's ledger is kept across runs, and `events` of run 2
    replayed run 1's (its sealed, durable and released files) as run 2's."""
    p = bw.up("ev2")
    save_weights(p["watch"] / "cell-a" / "a.safetensors", seed=1)
    bw.wait_durable("ev2", 1)
    bw.ok("pull", "ev2", "--to", str(tmp_path / "pulled"))
    bw.ok("verify", str(tmp_path / "pulled"))
    bw.ok("down", "ev2", "--confirm", "ev2")
    bw.ok("up", "ev2", "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
    save_weights(p["watch"] / "cell-b" / "b.safetensors", seed=2)
    bw.wait_durable("ev2", 1)
    lines = [json.loads(x) for x in bw.ok("events", "ev2", "--json").stdout.splitlines() if x.strip()]
    assert lines and lines[0]["kind"] == "SIDECAR_STARTED"
    assert not [e for e in lines if e.get("path") == "cell-a/a.safetensors"], lines
    assert [e["path"] for e in lines if e["kind"] == "ARTIFACT_SEALED"] == ["cell-b/b.safetensors"]


def test_a_dead_sidecar_whose_credentials_are_gone_is_adopted_with_new_ones(
    remote: Remote,  # noqa: F811
    s3: S3Server,
    tmp_path: Path,
) -> None:
    """Second review of issue 25: adopting a dead sidecar whose credentials file had left the box
    went in a circle (`--adopt` asked for --durable-credentials and refused them)."""
    creds = write_credentials(tmp_path / "creds")
    box, first = bucket_box(remote, s3, "ac1", creds)
    run = remote.bw.record("ac1")["run_id"]
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(first["pid"]), what="the sidecar gone")
    (box.home / ".boxwarden" / "boxes" / "ac1" / "sidecar" / "durable-credentials").unlink()
    other = second_controller(remote, tmp_path)
    try:
        r = up_as(remote, box, "ac1", "--adopt", bw=other, code=2)
        assert "give --durable-credentials FILE again" in r.stderr, r.stderr
        doc = up_as(remote, box, "ac1", "--adopt", "--durable-credentials", str(creds), bw=other)
        assert doc["started"] is True and doc["run_id"] == run and doc["durable"].startswith("s3://")
    finally:
        _exit_master(other, box)


def test_a_run_id_that_was_torn_down_is_never_taken_again(bw: Bw, tmp_path: Path) -> None:
    """Second review of issue 25: `up --run-id R1` was refused right after R1's teardown, but taken
    once another run had come and gone in between."""
    for run in ("r1", "r2"):
        bw.ok("up", "ri1", "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt", "--run-id", run)
        bw.ok("pull", "ri1", "--to", str(tmp_path / f"p-{run}"))
        bw.ok("verify", str(tmp_path / f"p-{run}"), "--allow-empty")
        bw.ok("down", "ri1", "--confirm", "ri1", "--pulled", str(tmp_path / f"p-{run}"))
    r = bw("up", "ri1", "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt", "--run-id", "r1")
    assert r.returncode == 2 and "run r1 of ri1 was torn down" in r.stderr, r.stderr


def test_an_empty_runs_acknowledgement_is_no_other_runs(bw: Bw, tmp_path: Path) -> None:
    """Second review of issue 25: `verify --allow-empty` of run 1's empty tree let run 2's empty
    teardown through (`down --pulled` that tree): every empty manifest has one digest."""
    args = ("--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt")
    bw.ok("up", "ea1", *args)
    first = tmp_path / "first"
    bw.ok("pull", "ea1", "--to", str(first))
    bw.ok("verify", str(first), "--allow-empty")
    bw.ok("down", "ea1", "--confirm", "ea1", "--pulled", str(first))
    bw.ok("up", "ea1", *args)
    r = bw("down", "ea1", "--confirm", "ea1", "--pulled", str(first), "--json")
    assert r.returncode == 3, r.stdout
    (why,) = [x for x in json.loads(r.stdout)["reasons"] if x["code"] == "NOT_PULLED"]
    assert "the pulled tree is of run" in why["detail"]


def test_a_rotation_whose_new_start_fails_says_the_box_is_unwatched(
    bw: Bw,
    s3: S3Server,
    tmp_path: Path,
) -> None:
    """Third review of issue 25: `up --durable-credentials NEW` stopped the running sidecar, the new
    one could not start (its metrics port taken), and the error said nothing of the stopped one nor
    of the credentials gone with it."""
    old = write_credentials(tmp_path / "old")
    args = (
        "--profile",
        "local",
        "--workdir",
        str(bw.cwd),
        "--watch",
        "ckpt",
        "--durable",
        s3.url(s3.bucket(), "ck"),
    )
    bw.ok("up", "rx1", *args, "--durable-credentials", str(old))
    pid = bw.record("rx1")["sidecar_pid"]
    new = tmp_path / "new"
    new.write_text(old.read_text().replace("[default]", "[default]\n# rotated"))
    new.chmod(0o600)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        r = bw("up", "rx1", *args, "--durable-credentials", str(new), "--metrics-port", port, timeout=120)
    said = " ".join(r.stderr.split())
    assert r.returncode != 0 and not pid_alive(pid), r.stderr
    assert f"the running sidecar of rx1 (pid {pid}) was stopped to restart it" in said, said
    assert "Nothing watches the box now" in said and "give --durable-credentials again" in said, said


def test_a_start_whose_run_cannot_be_marked_open_leaves_no_sidecar(
    remote: Remote,  # noqa: F811
) -> None:
    """Fifth review of issue 25: the box-side start spawned the sidecar, then could not mark its run
    open (a home that cannot be written): the start failed, nothing was recorded, and the sidecar
    ran on, which the next `up` called another controller's."""
    a = remote.bw
    box = remote.boxes("h1")
    blocked = "mkdir -p ~/.boxwarden && chmod 700 ~/.boxwarden && echo x > ~/.boxwarden/roots"
    assert box.run_as_box(["sh", "-c", blocked]).returncode == 0
    r = a("up", "sx", "--profile-file", str(remote.profile), "--host", box.alias, "--instance-id", "i-sx",
          "--workdir", "~/sx", "--watch", "ckpt", "--state-on-durable", timeout=300)  # fmt: skip
    assert r.returncode != 0, r.stdout
    sidecars = "ps -u $(id -u) -o args | grep -v grep | grep 'sidecar --config' || true"
    ps = box.run_as_box(["sh", "-c", sidecars])
    assert "sidecar --config" not in ps.stdout, ps.stdout
    _exit_master(a, box)
