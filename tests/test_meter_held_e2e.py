"""A meter stop held back by other boxes at work on the same instance (issue 25, sixth review): the
box whose `down` held it was called down with "the last of them to go down stops it", although
the box that held it might never send that stop (its controller names another instance, or it has
no controller at all). Now a held stop leaves its box unfinished (`meter-unproven`, METER_HELD):
its `down` again asks the box who is still at work there and sends the stop once none is; a stop
of the instance that another box's teardown proves closes it; a follower waits for it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import Bw, wait_until
from tests.controller.test_teardown_resume import INSTANCE, profile, provider_dir, stop_calls
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
        assert doc["teardown"]["gone"] is True and stop_calls(tmp_path) == 1
        out = ended(proc)
        assert proc.returncode == 0, log.read_text()
    finally:
        stop(proc)
    assert json.loads(out)["teardown"]["gone"] is True
    assert status_of(bw, "ha") == "down" and stop_calls(tmp_path) == 1  # never sent twice


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
