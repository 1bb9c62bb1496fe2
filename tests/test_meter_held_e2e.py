"""A meter stop held back by other boxes at work on the same instance (issue 25, sixth review): the
box whose `down` held it was called down with "the last of them to go down stops it", although
the box that held it might never send that stop (its controller names another instance, or it has
no controller at all). Now a held stop leaves its box unfinished (`meter-unproven`, METER_HELD):
its `down` again asks the box who is still at work there and sends the stop once none is; a stop
of the instance that another box's teardown proves closes it; a follower waits for it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import Bw, pid_alive, wait_until
from tests.controller.test_teardown_resume import INSTANCE, profile, provider_dir, stop_calls
from tests.sshbox import Box
from tests.test_identity_e2e import up_as
from tests.test_remote_e2e import (  # noqa: F401 - fixtures
    Remote,
    _exit_master,
    remote,
    venv_template,
    wheel_cache,
    write_as_box,
)
from tests.test_when_safe_e2e import ended, follower, stop


def up_on_instance(bw: Bw, tmp_path: Path, *names: str) -> None:
    for name in names:
        bw.ok("up", name, "--profile-file", str(profile(tmp_path)), "--instance-id", INSTANCE,
              "--workdir", str(bw.cwd), "--watch", f"ckpt-{name}")  # fmt: skip
        (bw.cwd / f"ckpt-{name}").mkdir(exist_ok=True)
        (bw.cwd / f"ckpt-{name}" / "w.bin").write_bytes(f"{name}'s weights".encode())
        bw.wait_durable(name, 1)
        bw.ok("pull", name, "--to", str(bw.cwd / f"pulled-{name}"))
        bw.ok("verify", str(bw.cwd / f"pulled-{name}"))


def status_of(bw: Bw, name: str) -> str:
    return str({b["box"]: b for b in bw.json("status")["boxes"]}[name]["status"])


def test_a_follower_waits_for_a_held_stop_and_ends_when_the_last_box_stops_the_instance(
    bw: Bw, tmp_path: Path
) -> None:
    (provider_dir(tmp_path) / "complete").touch()  # the provider ends an instance at its stop
    up_on_instance(bw, tmp_path, "ha", "hb")
    log = tmp_path / "follower.log"
    proc = follower(bw, bw.cwd / "pulled-ha", log, "ha")
    try:
        wait_until(lambda: b"the other boxes at work on instance" in log.read_bytes(), what="the held stop")
        assert proc.poll() is None, log.read_text()
        assert status_of(bw, "ha") == "meter-unproven" and stop_calls(tmp_path) == 0
        doc = bw.json("down", "hb", "--confirm", "hb")  # the last box on the instance stops it
        assert doc["teardown"]["gone"] is True and stop_calls(tmp_path) >= 1
        out = ended(proc)
        assert proc.returncode == 0, log.read_text()
    finally:
        stop(proc)
    assert json.loads(out)["teardown"]["gone"] is True and status_of(bw, "ha") == "down"
    # (the follower may send it too, if it looks while hb's stop is on its way: both passed their gate)
    assert stop_calls(tmp_path) <= 2


def test_down_all_of_two_boxes_on_one_instance_stops_it_once_and_both_are_down(
    bw: Bw, tmp_path: Path
) -> None:
    (provider_dir(tmp_path) / "complete").touch()
    up_on_instance(bw, tmp_path, "ha", "hb")
    doc = bw.json("down", "--all", "--confirm-count", "2")
    outcomes = {o["box"]: o["outcome"] for o in doc["boxes"]}
    assert outcomes == {"ha": "torn-down", "hb": "torn-down"}, doc
    assert status_of(bw, "ha") == status_of(bw, "hb") == "down"
    assert 1 <= stop_calls(tmp_path) <= 2  # (two teardowns at once may both send it)


def test_a_box_at_work_under_another_instance_id_holds_the_stop_until_it_is_down(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Fifth review, 5-3: a box on the box's own disk counts as on the instance whatever id its
    controller gave it, and the held `down` exited 0 saying the last of them stops the meter: that
    box's own `down` stops its other id, so nothing ever stopped this one."""
    bw = remote.bw
    box = remote.boxes("h1")
    remote.provider("create", "i-hc01", "--linger", "1")
    remote.provider("create", "i-hx01", "--linger", "1")
    up_as(remote, box, "hc01", "--workdir", "~/hc", "--watch", "ckpt")  # instance i-hc01
    up_as(remote, box, "hx01", "--workdir", "~/hx", "--watch", "ckpt")  # the same host, called i-hx01
    for n, d in (("hc01", "hc"), ("hx01", "hx")):
        write_as_box(box, f"{d}/ckpt/{n}.bin", f"{n}'s weights")
        bw.wait_durable(n, 1)
        bw.ok("pull", n, "--to", str(bw.cwd / f"p-{n}"))
        bw.ok("verify", str(bw.cwd / f"p-{n}"))

    def deletes() -> list[str]:
        calls = json.loads((tmp_path / "provider.json").read_text())["calls"]
        return [i for verb, i in calls if verb == "delete"]

    try:
        r = bw("down", "hc01", "--confirm", "hc01", "--json", timeout=180)
        assert r.returncode == 3 and "METER_HELD" in r.stderr, r.stderr
        assert "hx01 (its sidecar runs (its controller names the instance i-hx01)" in r.stderr, r.stderr
        assert deletes() == [] and status_of(bw, "hc01") == "meter-unproven"
        doc = bw.json("down", "hx01", "--confirm", "hx01")  # it stops its own id, not hc01's
        assert doc["teardown"]["gone"] is True and deletes() == ["i-hx01"]
        assert status_of(bw, "hc01") == "meter-unproven"  # another instance's stop closes nothing here
        doc = bw.json("down", "hc01", "--confirm", "hc01")  # nothing at work there now: sent
        assert doc["teardown"]["gone"] is True and deletes() == ["i-hx01", "i-hc01"], doc
        assert status_of(bw, "hc01") == "down"
    finally:
        _exit_master(bw, box)


def test_another_state_home_on_this_machine_holds_the_stop_of_its_instance(bw: Bw, tmp_path: Path) -> None:
    """Sixth review: on a box of kind local (the controller runs on the instance it stops), only
    this controller's records were asked: `down` stopped the instance under a job of a box that
    another BOXWARDEN_HOME of the same user had there."""
    from tests.controller.test_meter_stop import calls, fake_profile, provider

    provider(bw, tmp_path, "create", "i-1")
    profile = fake_profile(tmp_path)
    other = Bw(tmp_path / "home-b", bw.cwd)
    other.env.update(HOME=bw.env["HOME"], FAKE_PROVIDER_STATE=bw.env["FAKE_PROVIDER_STATE"])  # one user
    for c, n in ((bw, "la"), (other, "lb")):
        (bw.cwd / n).mkdir()
        c.ok("up", n, "--profile-file", str(profile), "--instance-id", "i-1", "--workdir", str(bw.cwd / n),
             "--watch", "ckpt")  # fmt: skip
    try:
        (bw.cwd / "la" / "ckpt").mkdir(exist_ok=True)
        (bw.cwd / "la" / "ckpt" / "w.bin").write_bytes(b"la's weights")
        bw.wait_durable("la", 1)
        bw.ok("pull", "la", "--to", str(bw.cwd / "p-la"))
        bw.ok("verify", str(bw.cwd / "p-la"))
        r = bw("down", "la", "--confirm", "la", "--json")
        assert r.returncode == 3 and "METER_HELD" in r.stderr and "lb (its sidecar runs" in r.stderr, r.stderr
        assert ["delete", "i-1"] not in calls(tmp_path)
        (bw.cwd / "lb" / "ckpt").mkdir(exist_ok=True)
        (bw.cwd / "lb" / "ckpt" / "w.bin").write_bytes(b"lb's weights")
        other.wait_durable("lb", 1)
        other.ok("pull", "lb", "--to", str(bw.cwd / "p-lb"))
        other.ok("verify", str(bw.cwd / "p-lb"))
        doc = other.json("down", "lb", "--confirm", "lb")  # la's run is over on the machine: not held
        assert doc["teardown"]["gone"] is True and calls(tmp_path).count(["delete", "i-1"]) == 1
        doc = bw.json("down", "la", "--confirm", "la")  # asked again: the instance is gone
        assert doc["teardown"]["gone"] is True and calls(tmp_path).count(["delete", "i-1"]) == 1
    finally:
        other.cleanup()


def test_a_stop_under_another_profile_closes_no_box_held_on_an_instance_of_the_same_id(
    bw: Bw, tmp_path: Path
) -> None:
    """Seventh review: the same instance id under two providers (or accounts) is two instances; a
    proven stop of one closed the box held on the other, whose meter nobody ever stopped."""
    from tests.controller.test_meter_stop import FAKE, fake_profile

    def cloud(name: str) -> tuple[Path, Path]:
        state = tmp_path / f"{name}.json"
        cli = tmp_path / f"{name}-cli.py"  # the same fake CLI, its own state: another provider
        cli.write_text(
            f"import os, runpy, sys\nos.environ['FAKE_PROVIDER_STATE'] = {str(state)!r}\n"
            f"sys.argv = [{str(FAKE)!r}, *sys.argv[1:]]\nrunpy.run_path({str(FAKE)!r}, run_name='__main__')\n"
        )
        text = fake_profile(tmp_path).read_text().replace('name = "fakecloud"', f'name = "{name}"')
        profile = tmp_path / f"{name}.toml"
        profile.write_text(text.replace(json.dumps(str(FAKE)), json.dumps(str(cli))))
        subprocess.run([sys.executable, str(cli), "create", "12345"], check=True, capture_output=True)
        return profile, state

    (p1, _), (p2, s2) = cloud("cloud-one"), cloud("cloud-two")
    for n, p in (("ca", p1), ("cb", p2)):
        (bw.cwd / n / "ckpt").mkdir(parents=True)
        bw.ok("up", n, "--profile-file", str(p), "--instance-id", "12345", "--workdir", str(bw.cwd / n),
              "--watch", "ckpt")  # fmt: skip
        (bw.cwd / n / "ckpt" / "w.bin").write_bytes(f"{n}'s weights".encode())
        bw.wait_durable(n, 1)
        bw.ok("pull", n, "--to", str(bw.cwd / f"p-{n}"))
        bw.ok("verify", str(bw.cwd / f"p-{n}"))
    r = bw("down", "cb", "--confirm", "cb", "--json", timeout=120)  # (counting holders: any profile)
    assert r.returncode == 3 and "METER_HELD" in r.stderr, r.stderr
    assert bw.json("down", "ca", "--confirm", "ca")["teardown"]["gone"] is True
    assert status_of(bw, "cb") == "meter-unproven"  # its own provider was never asked
    assert "12345" in json.loads(s2.read_text())["instances"]
    doc = bw.json("down", "cb", "--confirm", "cb")  # asked again: its own stop, under its own profile
    assert doc["teardown"]["gone"] is True and "12345" not in json.loads(s2.read_text())["instances"]


def test_another_controllers_run_of_the_same_name_and_id_still_holds_the_stop(bw: Bw, tmp_path: Path) -> None:
    """Seventh review: the runs a controller tore down were passed to the box by box name; another
    controller's open run of the same name and run id, elsewhere on the machine, was taken for one
    of them, and the stop was sent under it."""
    from tests.controller.test_meter_stop import calls, fake_profile, provider

    for i in ("i-0", "i-1"):
        provider(bw, tmp_path, "create", i)
    profile = fake_profile(tmp_path)
    other = Bw(tmp_path / "home-b", bw.cwd)
    other.env.update(HOME=bw.env["HOME"], FAKE_PROVIDER_STATE=bw.env["FAKE_PROVIDER_STATE"])  # one user

    def up(c: Bw, name: str, wd: str, instance: str, *extra: str) -> None:
        (bw.cwd / wd / "ckpt").mkdir(parents=True, exist_ok=True)
        c.ok("up", name, "--profile-file", str(profile), "--instance-id", instance,
             "--workdir", str(bw.cwd / wd), "--watch", "ckpt", *extra)  # fmt: skip

    def pulled(c: Bw, name: str, wd: str) -> None:
        (bw.cwd / wd / "ckpt" / "w.bin").write_bytes(f"{wd}'s weights".encode())
        c.wait_durable(name, 1)
        c.ok("pull", name, "--to", str(bw.cwd / f"p-{wd}"))
        c.ok("verify", str(bw.cwd / f"p-{wd}"))

    try:
        up(bw, "x", "ax", "i-0", "--run-id", "exp1")  # this controller's x/exp1, torn down
        pulled(bw, "x", "ax")
        assert bw("down", "x", "--confirm", "x", "--json", timeout=120).returncode == 0
        up(other, "x", "bx", "i-1", "--run-id", "exp1")  # the other's x/exp1, at work on i-1
        (pid,) = other.sidecar_pids()
        os.kill(pid, signal.SIGKILL)  # its sidecar dies; its run is not over
        wait_until(lambda: not pid_alive(pid), what="the other x's sidecar gone")
        up(bw, "y", "ay", "i-1")
        pulled(bw, "y", "ay")
        r = bw("down", "y", "--confirm", "y", "--json", timeout=120)
        assert r.returncode == 3 and "METER_HELD" in r.stderr and "x (run exp1 never torn down" in r.stderr, (
            r.stderr
        )
        assert ["delete", "i-1"] not in calls(tmp_path)
    finally:
        other.cleanup()


def test_down_all_reports_a_box_held_earlier_as_down_once_its_instance_stops(bw: Bw, tmp_path: Path) -> None:
    """Seventh review: a box held by an earlier `down` was reported refused by `down --all`, whose
    other box's stop had just closed it."""
    (provider_dir(tmp_path) / "complete").touch()
    up_on_instance(bw, tmp_path, "ha", "hb")
    r = bw("down", "ha", "--confirm", "ha", "--json")
    assert r.returncode == 3 and "METER_HELD" in r.stderr, r.stderr
    doc = bw.json("down", "--all", "--confirm-count", "1")
    assert {o["box"]: o["outcome"] for o in doc["boxes"]} == {"ha": "torn-down", "hb": "torn-down"}, doc
    assert status_of(bw, "ha") == status_of(bw, "hb") == "down" and stop_calls(tmp_path) == 1


def pulled_on(remote: Remote, box: Box, name: str, wd: str) -> None:  # noqa: F811
    """A checkpoint of box `name` (working dir ~/`wd`) written, durable, pulled and verified."""
    a = remote.bw
    write_as_box(box, f"{wd}/ckpt/{name}.bin", f"{name}'s weights")
    a.wait_durable(name, 1)
    a.ok("pull", name, "--to", str(a.cwd / f"p-{name}"))
    a.ok("verify", str(a.cwd / f"p-{name}"))


def held_by_theirs(remote: Remote, box: Box, b: Bw) -> int:  # noqa: F811
    """a-zz01 (this controller's, pulled and verified) and b-zz01 (controller `b`'s) at work on one
    instance; `down a-zz01` is held by b-zz01. The pid of b-zz01's sidecar."""
    a = remote.bw
    up_as(remote, box, "a-zz01", "--workdir", "~/ha", "--watch", "ckpt")
    theirs = up_as(remote, box, "b-zz01", "--workdir", "~/hb", "--watch", "ckpt", bw=b)
    pulled_on(remote, box, "a-zz01", "ha")
    r = a("down", "a-zz01", "--confirm", "a-zz01", "--json", timeout=200)
    assert r.returncode == 3 and "METER_HELD" in r.stderr, r.stderr
    return int(theirs["pid"])


def test_a_held_stop_is_not_sent_when_the_host_only_refuses_connections(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Seventh review: `down` again of a held box took a host that refused the connection (an sshd
    restarting, a port mapping changed) for nobody at work there, and sent the stop under another
    controller's running box."""
    from tests.sshbox import free_port
    from tests.test_box_gone_e2e import point_at
    from tests.test_identity_e2e import second_controller

    a = remote.bw
    box = remote.boxes("h1")
    remote.provider("create", "i-zz01", "--linger", "1")
    b = second_controller(remote, tmp_path)
    text = box.config.read_text()
    try:
        held_by_theirs(remote, box, b)
        _exit_master(a, box)
        point_at(box, free_port())  # the host refuses connections for a while
        r = a("down", "a-zz01", "--confirm", "a-zz01", "--json", timeout=200)
        said = " ".join(r.stderr.split())
        assert r.returncode == 3 and "no link reaches the host" in said, said
        # (eighth review: nothing is known to be at work there; the way out is named)
        assert "the host could not say whether other boxes are at work" in said and "--resend-stop" in said
        assert "still at work" not in said
        calls = json.loads((tmp_path / "provider.json").read_text())["calls"]
        assert ["delete", "i-zz01"] not in calls, calls
    finally:
        box.config.write_text(text)
        _exit_master(a, box)
        _exit_master(b, box)


def test_up_refuses_an_instance_its_provider_does_not_list(bw: Bw, tmp_path: Path) -> None:
    """Eighth review: an instance id the provider never had (a typo, another account) was accepted
    at `up`; at `down` the provider's "not found" read as "gone", and the box was called down while
    the instance it meant kept billing."""
    from tests.controller.test_meter_stop import calls, fake_profile, provider

    provider(bw, tmp_path, "create", "i-1")
    (bw.cwd / "x").mkdir()
    r = bw("up", "x", "--profile-file", str(fake_profile(tmp_path)), "--instance-id", "i-l",
           "--workdir", str(bw.cwd / "x"), "--watch", "ckpt")  # fmt: skip
    assert r.returncode == 2 and "does not list i-l" in r.stderr and "--instance-id" in r.stderr, r.stderr
    assert bw("status", "x").returncode != 0 and ["delete", "i-l"] not in calls(tmp_path)


def test_a_run_of_the_same_name_and_id_on_another_instance_still_holds_the_stop(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Eighth review: this controller's torn-down x/exp1 (on i-zz03) was matched by state-dir path
    alone; a new machine at the same address, with the same home layout, ran another controller's
    x/exp1 on i-zz04, and a stop of i-zz04 was sent under that open run."""
    from tests.test_identity_e2e import second_controller

    box = remote.boxes("h1")
    a = remote.bw
    b = second_controller(remote, tmp_path)

    try:
        up_as(remote, box, "x-zz03", "--workdir", "~/wx", "--watch", "ckpt", "--run-id", "exp1")
        pulled_on(remote, box, "x-zz03", "wx")
        assert a("down", "x-zz03", "--confirm", "x-zz03", "--json", timeout=200).returncode == 0
        _exit_master(a, box)
        for d in (".boxwarden/boxes/x-zz03", "boxwarden/x-zz03"):  # a new machine, the same layout
            assert box.run_as_box(["rm", "-rf", str(box.home / d)]).returncode == 0
        theirs = up_as(remote, box, "x-zz03", "--instance-id", "i-zz04", "--workdir", "~/wx",
                       "--watch", "ckpt", "--run-id", "exp1", bw=b)  # fmt: skip
        assert box.run_as_box(["kill", "-9", str(theirs["pid"])]).returncode == 0
        wait_until(lambda: not pid_alive(theirs["pid"]), what="their sidecar gone")  # their run: open
        up_as(remote, box, "y-zz04", "--workdir", "~/wy", "--watch", "ckpt")
        pulled_on(remote, box, "y-zz04", "wy")
        r = a("down", "y-zz04", "--confirm", "y-zz04", "--json", timeout=200)
        assert r.returncode == 3 and "x-zz03 (run exp1 never torn down" in r.stderr, r.stderr
        calls = json.loads((tmp_path / "provider.json").read_text())["calls"]
        assert ["delete", "i-zz04"] not in calls, calls
    finally:
        _exit_master(a, box)
        _exit_master(b, box)


def test_another_controllers_run_in_the_boxs_own_state_dir_holds_its_stop(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Ninth review: the box's own state dir was never looked at; another controller's box of the
    same name on the same host opened its run there after this box's held teardown, its sidecar
    died, and `down` again of this box sent the stop under it."""
    from tests.test_identity_e2e import second_controller

    a = remote.bw
    box = remote.boxes("h1")
    remote.provider("create", "i-zz05", "--linger", "1")
    b = second_controller(remote, tmp_path)

    try:
        up_as(remote, box, "x-zz05", "--workdir", "~/wx", "--watch", "ckpt")
        up_as(remote, box, "y-zz05", "--workdir", "~/wy", "--watch", "ckpt")
        pulled_on(remote, box, "x-zz05", "wx")
        assert a("down", "x-zz05", "--confirm", "x-zz05", "--json", timeout=200).returncode == 3  # held by y
        theirs = up_as(remote, box, "x-zz05", "--workdir", "~/bx", "--watch", "ckpt", bw=b)
        # (tenth review: their sidecar answering at this box's socket is not this box's: still held)
        r = a("down", "x-zz05", "--confirm", "x-zz05", "--json", timeout=200)
        assert r.returncode == 3 and "x-zz05 (its sidecar runs" in r.stderr, r.stderr
        doc = a.json("down", "--all", "--dry-run", code=3)  # (eleventh review: the fleet asks the same)
        assert {o["box"]: o["outcome"] for o in doc["boxes"]}["x-zz05"] == "refused", doc
        assert box.run_as_box(["kill", "-9", str(theirs["pid"])]).returncode == 0
        wait_until(lambda: not pid_alive(theirs["pid"]), what="their sidecar gone")  # their run: open
        pulled_on(remote, box, "y-zz05", "wy")
        assert (
            a("down", "y-zz05", "--confirm", "y-zz05", "--json", timeout=200).returncode == 3
        )  # held by theirs
        r = a("down", "x-zz05", "--confirm", "x-zz05", "--json", timeout=200)
        assert r.returncode == 3 and f"x-zz05 (run {theirs['run_id']} never torn down" in r.stderr, r.stderr
        calls = json.loads((tmp_path / "provider.json").read_text())["calls"]
        assert not [c for c in calls if c[0] == "delete"], calls
    finally:
        _exit_master(a, box)
        _exit_master(b, box)


def test_a_held_stop_says_what_holds_it_and_a_way_out_that_works(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Ninth review: a stop held because the host answered but could not say offered
    `--resend-stop`, which holds there too; the way out is the provider's own stop."""
    from tests.sshbox import free_port
    from tests.test_box_gone_e2e import dropping_sshd, point_at
    from tests.test_identity_e2e import second_controller

    a = remote.bw
    box = remote.boxes("h1")
    remote.provider("create", "i-zz01", "--linger", "1")
    b = second_controller(remote, tmp_path)
    text = box.config.read_text()
    try:
        their_pid = held_by_theirs(remote, box, b)
        r = a("down", "a-zz01", "--dry-run", timeout=200)  # what was recorded, in the past tense
        said = " ".join(r.stderr.split())
        assert r.returncode == 3 and "was held at" in said and "still at work" not in said, said
        _exit_master(a, box)
        with dropping_sshd() as port:  # the host answers, and drops every login
            point_at(box, port)
            r = a("down", "a-zz01", "--confirm", "a-zz01", "--resend-stop", timeout=200)
        said = " ".join(r.stderr.split())
        assert r.returncode == 3 and "the host could not say" in said, said
        assert "--resend-stop` sends" not in said and "stop the instance at the provider yourself" in said
        remote.provider("delete", "i-zz01")  # the user stops it at the provider: all on it ends
        remote.provider("vanish", "i-zz01")
        assert box.run_as_box(["kill", "-9", str(their_pid)]).returncode == 0
        wait_until(lambda: not pid_alive(their_pid), what="their sidecar gone with the instance")
        point_at(box, free_port())  # and its host with it
        doc = a.json("down", "a-zz01", "--confirm", "a-zz01")  # the provider first: gone, nothing held
        assert doc["teardown"]["gone"] is True and doc["teardown"]["meter"]["sent"] is False
    finally:
        box.config.write_text(text)
        _exit_master(a, box)
        _exit_master(b, box)


def test_a_box_proven_gone_by_its_provider_is_held_by_nobody(bw: Bw, tmp_path: Path) -> None:
    """Ninth review: `down --box-gone` of a box whose instance the provider says is gone refused,
    held by another box on that same (gone) instance."""
    up_on_instance(bw, tmp_path, "ga", "gb")
    for pid in bw.sidecar_pids():
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda pid=pid: not pid_alive(pid), what="the sidecars gone")
    (provider_dir(tmp_path) / f"gone-{INSTANCE}").touch()  # the provider: no such instance
    d = bw.cwd / "from-durable"
    bw.ok("pull", "ga", "--from", "durable", "--to", str(d))
    bw.ok("verify", str(d))
    r = bw("down", "ga", "--confirm", "ga", "--box-gone", "--pulled", str(d), "--json")
    assert r.returncode == 0 and "METER_HELD" not in r.stderr, r.stderr
    assert json.loads(r.stdout)["teardown"]["gone"] is True and stop_calls(tmp_path) == 0


def test_down_refuses_while_the_provider_is_asked_elsewhere_than_at_up(bw: Bw, tmp_path: Path) -> None:
    """Tenth review: a provider CLI that takes its account, region or context from the shell was
    asked elsewhere at `down`; its "not found" read as "gone", and the box was called down while
    its instance billed on. Its sidecar answers: the instance is there, so nothing is released."""
    from tests.controller.test_meter_stop import calls, fake_profile, provider

    provider(bw, tmp_path, "create", "i-1")
    (bw.cwd / "cb" / "ckpt").mkdir(parents=True)
    bw.ok("up", "cb", "--profile-file", str(fake_profile(tmp_path)), "--instance-id", "i-1",
          "--workdir", str(bw.cwd / "cb"), "--watch", "ckpt")  # fmt: skip
    (bw.cwd / "cb" / "ckpt" / "w.bin").write_bytes(b"cb's weights")
    bw.wait_durable("cb", 1)
    bw.ok("pull", "cb", "--to", str(bw.cwd / "p-cb"))
    bw.ok("verify", str(bw.cwd / "p-cb"))
    bw.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "other-account.json")  # the shell points elsewhere
    r = bw("down", "cb", "--confirm", "cb", "--json")
    assert r.returncode == 3 and "PROVIDER_DISAGREES" in r.stderr, r.stderr
    assert status_of(bw, "cb") == "up" and (bw.cwd / "cb" / "ckpt" / "w.bin").exists()  # nothing released
    bw.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "provider.json")
    assert ["delete", "i-1"] not in calls(tmp_path)
    assert bw.json("down", "cb", "--confirm", "cb")["teardown"]["gone"] is True  # from where it lists it


def test_an_id_never_listed_is_not_taken_on_trust_when_the_provider_cannot_be_asked(
    bw: Bw, tmp_path: Path
) -> None:
    """Tenth review: a box up under a manual meter (its id never checked) whose profile became an
    argv stop was brought up again while the provider could not be asked, with a warning only."""
    from tests.controller.test_meter_stop import FAKE, fake_profile, provider

    provider(bw, tmp_path, "create", "i-real")
    argv_text = (
        fake_profile(tmp_path)
        .read_text()
        .replace(f"[{json.dumps(sys.executable)}, {json.dumps(str(FAKE))}, ", '["/nonexistent/fakecli", ')
    )
    head, tail = argv_text.split("[meter_stop]")[0], argv_text.split("[detach]")[1]
    manual = (
        '[meter_stop]\nverb = "destroy"\nirreversible = true\nmode = "manual"\nmanual = "Destroy it."\n\n'
    )
    profile = tmp_path / "mine" / "fakecloud.toml"
    profile.parent.mkdir()
    profile.write_text(head + manual + "[detach]" + tail)
    args = (
        "--profile-file",
        str(profile),
        "--instance-id",
        "i-typo",
        "--workdir",
        str(bw.cwd),
        "--watch",
        "ckpt",
    )
    bw.ok("up", "kb", *args)
    profile.write_text(argv_text)  # an argv stop now, whose CLI cannot run here
    r = bw("up", "kb", *args)
    assert r.returncode == 2 and "could not be asked" in r.stderr, r.stderr


def test_a_root_the_box_cannot_read_is_no_box_at_work(remote: Remote, tmp_path: Path) -> None:  # noqa: F811
    """Tenth review: a state root the box user cannot read (another Unix user's, on a shared tier)
    was named like a box at work ("once they are down"), with no way out."""
    a = remote.bw
    box = remote.boxes("h1")
    remote.profile.write_text(remote.profile.read_text().replace('path = "~"', 'path = "~/persist"'))
    assert box.run_as_box(["mkdir", "-p", str(box.home / "persist")]).returncode == 0
    locked = box.home / "persist" / ".boxwarden"
    locked.mkdir()  # root's, 0700: the box user cannot list it
    locked.chmod(0o700)
    try:
        up_as(remote, box, "rd01", "--workdir", "~/rd", "--watch", "ckpt")
        write_as_box(box, "rd/ckpt/a.bin", "weights")
        a.wait_durable("rd01", 1)
        a.ok("pull", "rd01", "--to", str(a.cwd / "prd"))
        a.ok("verify", str(a.cwd / "prd"))
        r = a("down", "rd01", "--confirm", "rd01", "--json", timeout=200)
        said = " ".join(r.stderr.split())
        assert r.returncode == 3 and "METER_HELD" in said and "cannot be read" in said, said
        assert (
            "the host could not say whether other boxes are at work" in said and "still at work" not in said
        )
    finally:
        _exit_master(a, box)


def _pulled_on(bw: Bw, profile: Path, name: str, instance: str = "i-1") -> None:
    (bw.cwd / name / "ckpt").mkdir(parents=True, exist_ok=True)
    bw.ok("up", name, "--profile-file", str(profile), "--instance-id", instance,
          "--workdir", str(bw.cwd / name), "--watch", "ckpt")  # fmt: skip
    n = len(list(bw.cwd.glob(f"p-{name}-*")))  # (a new run claims what is on the box now)
    (bw.cwd / name / "ckpt" / f"{n}.bin").write_bytes(b"weights")
    bw.wait_durable(name, len(list((bw.cwd / name / "ckpt").iterdir())), pending_ok=True)
    bw.ok("pull", name, "--to", str(bw.cwd / f"p-{name}-{n}"))
    bw.ok("verify", str(bw.cwd / f"p-{name}-{n}"))


def test_a_provider_asked_elsewhere_is_not_taken_on_any_path(bw: Bw, tmp_path: Path) -> None:
    """Eleventh review: the provider check before the release was skipped after an earlier stop
    (a box brought up again since); and a held box's `down` took the other account's "not found"
    for gone while the box that held it answered on the instance."""
    from tests.controller.test_meter_stop import calls, fake_profile, provider

    provider(bw, tmp_path, "create", "i-1", "--stuck")  # its delete never completes
    profile = fake_profile(tmp_path, timeout_s=2)
    _pulled_on(bw, profile, "ra")
    assert bw("down", "ra", "--confirm", "ra").returncode == 1  # sent, never proven
    _pulled_on(bw, profile, "ra")  # brought up again: the instance is there
    _pulled_on(bw, profile, "rb")
    bw.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "other-account.json")  # the shell points elsewhere
    r = bw("down", "ra", "--confirm", "ra", "--json")
    assert r.returncode == 3 and "PROVIDER_DISAGREES" in r.stderr, r.stderr
    bw.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "provider.json")
    assert bw("down", "ra", "--confirm", "ra", "--json").returncode == 3  # held by rb, in the right account
    assert status_of(bw, "ra") == "meter-unproven"
    bw.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "other-account.json")
    r = bw("down", "ra", "--confirm", "ra", "--json")  # the held box: rb answers on i-1
    assert r.returncode == 3 and "PROVIDER_DISAGREES" in r.stderr and "rb" in r.stderr, r.stderr
    bw.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "provider.json")
    assert status_of(bw, "ra") == "meter-unproven" and status_of(bw, "rb") == "up"
    assert calls(tmp_path).count(["delete", "i-1"]) == 1  # only the first, proven never


def test_a_continued_teardown_asks_the_host_before_the_providers_gone(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Twelfth review: a `down` cut after its release, the sidecar then dead on a host that stays
    up; the `down` that continued it, asking the provider in another account, took its "not found"
    for gone: the box was called down (and its sidecar gone) while its instance billed on."""
    from controller.state import State

    a = remote.bw
    box = remote.boxes("h1")
    first = remote.up(box, seeded=True)
    write_as_box(box, "ckpt/a.bin", "weights")
    a.wait_durable("h1", 1)
    a.ok("pull", "h1", "--to", str(a.cwd / "p"))
    a.ok("verify", str(a.cwd / "p"))
    state = State(a.home)
    try:  # a `down` cut after it asked the release
        state.step(state.get("h1").with_(status="tearing-down"), "release", "no answer yet")
    finally:
        state.close()
    assert box.run_as_box(["kill", "-9", str(first["pid"])]).returncode == 0
    wait_until(lambda: not pid_alive(first["pid"]), what="the sidecar gone; its host stays up")
    refused_from_another_account(remote, box, tmp_path)
    assert status_of(a, "h1") == "tearing-down"


def test_an_unproven_stop_asks_the_host_before_the_providers_gone(
    remote: Remote,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Thirteenth review: a stop sent but never proven (a slow delete), then `down` again from a shell
    whose provider CLI asks another account: its "not found" was taken for gone while the box's host
    answered and its instance billed on. A dead sidecar says nothing of its instance."""
    a = remote.bw
    box = remote.boxes("h1")
    remote.provider("create", "i-h1", "--stuck")  # its delete never completes
    remote.profile.write_text(remote.profile.read_text().replace("timeout_s = 30", "timeout_s = 1"))
    remote.up(box, seeded=True)
    write_as_box(box, "ckpt/a.bin", "weights")
    a.wait_durable("h1", 1)
    a.ok("pull", "h1", "--to", str(a.cwd / "p"))
    a.ok("verify", str(a.cwd / "p"))
    assert a("down", "h1", "--confirm", "h1", "--json", timeout=200).returncode == 1  # sent, unproven
    refused_from_another_account(remote, box, tmp_path)
    assert status_of(a, "h1") == "meter-unproven"


def refused_from_another_account(remote: Remote, box: Box, tmp_path: Path) -> None:  # noqa: F811
    """`down h1`, its provider CLI asking another account (where i-h1 is not found), is refused while
    its host answers."""
    a = remote.bw
    a.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "other-account.json")
    try:
        r = a("down", "h1", "--confirm", "h1", "--json", timeout=200)
        assert r.returncode == 3 and "PROVIDER_DISAGREES" in r.stderr and "h1's host" in r.stderr, r.stderr
    finally:
        a.env["FAKE_PROVIDER_STATE"] = str(tmp_path / "provider.json")
        _exit_master(a, box)
