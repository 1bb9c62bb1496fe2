"""Trust on the box side (issue 25, finding 7). boxwarden's own directories on a box are 0700: made
so, or tightened when an older boxwarden left them open, and refused when another user owns one
(or owns a symbolic link in its place).
A wheelhouse is installed only by the sha256 digests this controller computed: a wheel changed
after it was hashed, or one in the box's wheel directory that the controller did not send, stops
the install before anything of it runs, saying which. A real sshd on loopback, box users of its
own; the tampering runs the controller's bootstrap in this process, over the same link."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest

from controller import remote as bootstrap_remote
from controller.errors import ControllerError
from controller.ssh.argv import Destination
from controller.ssh.connector import SshConnector
from tests.sshbox import Box
from tests.test_remote_e2e import Remote, _wheelhouse, remote, sidecars, venv_template, wheel_cache  # noqa: F401


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def as_box(box: Box, *dirs: Path, perm: int = 0o755) -> None:
    """Make `dirs` (in order) as the box user's, with `perm`: as an older boxwarden left them."""
    for d in dirs:
        d.mkdir(mode=perm, exist_ok=True)
        d.chmod(perm)
        os.chown(d, box.uid, box.gid)


def test_up_makes_boxwarden_s_dirs_0700_and_tightens_the_ones_others_could_enter(remote: Remote) -> None:  # noqa: F811
    box = remote.boxes("t1")
    state = box.home / ".boxwarden"
    as_box(box, state, state / "boxes", state / "venvs", state / "s")
    (state / "boxes").chmod(0o777)
    remote.up(box, seeded=True)
    for d in (state, state / "boxes", state / "venvs", state / "wheels", state / "s", state / "boxes" / "t1"):
        assert mode(d) == 0o700, f"{d} is {mode(d):o}"
        assert d.stat().st_uid == box.uid


def test_state_on_a_durable_tier_is_0700_too(remote: Remote) -> None:  # noqa: F811
    box = remote.boxes("t2")
    profile = remote.profile
    profile.write_text(profile.read_text().replace('path = "~"', 'path = "~/persist"'))
    assert box.run_as_box(["mkdir", "-p", str(box.home / "persist")]).returncode == 0
    remote.up(box, "--state-on-durable")
    persist = box.home / "persist" / ".boxwarden"
    home = box.home / ".boxwarden"
    for d in (persist, persist / "boxes", persist / "venvs", persist / "boxes" / "t2", home, home / "s"):
        assert mode(d) == 0o700, f"{d} is {mode(d):o}"


def test_a_box_dir_another_user_owns_is_refused_and_left_alone(remote: Remote) -> None:  # noqa: F811
    box, other = remote.boxes("t3"), remote.boxes("t4")
    state = box.home / ".boxwarden"
    as_box(other, state)  # made by another user of the box: not boxwarden's to make private
    r = remote.up(box, code=1)
    assert f"{state} must be a private directory" in r["stderr"], r["stderr"]
    assert f"belongs to uid {other.uid}" in r["stderr"] and "remove it" in r["stderr"]
    assert not sidecars(box)
    assert (state.stat().st_uid, mode(state)) == (other.uid, 0o755) and list(state.iterdir()) == []
    # Another user's link there, to a directory the SSH user owns: that user chose where it leads.
    shutil.rmtree(state)
    mine = box.home / "mine"
    as_box(box, mine, perm=0o700)
    state.symlink_to(mine)
    os.lchown(state, other.uid, other.gid)
    r = remote.up(box, code=1)
    assert f"{state} must be a private directory" in r["stderr"], r["stderr"]
    assert f"it is a symbolic link of uid {other.uid}" in r["stderr"]
    assert not sidecars(box) and list(mine.iterdir()) == []


class Tampering(SshConnector):
    """The box's real link, whose copy of the wheelhouse sends other bytes than the controller
    hashed for one wheel (as if the wheelhouse changed between hashing and sending)."""

    def __init__(self, dest: Destination, *, home: Path, tag: str, scratch: Path) -> None:
        super().__init__(dest, home=home, tag=tag)
        self.scratch = scratch

    async def put(self, files: Sequence[Path], remote_dir: str, *, timeout_s: float = 600.0) -> None:
        self.scratch.mkdir(exist_ok=True)
        sent = []
        for f in files:
            sent.append(self.scratch / f.name)
            shutil.copyfile(f, sent[-1])
            if f.name.startswith("blake3-"):
                with open(sent[-1], "r+b") as fh:
                    fh.seek(100)
                    fh.write(b"\xff" * 16)
        await super().put(sent, remote_dir, timeout_s=timeout_s)


def bootstrap(rig: Remote, box: Box, *, tamper: bool = False) -> str:
    """The controller's probe and venv install of `box`, in this process; the venv's python."""

    async def go() -> str:
        dest = Destination(box.alias, (), str(box.config))
        home = rig.bw.home
        if tamper:
            conn: SshConnector = Tampering(dest, home=home, tag=box.alias, scratch=rig.tmp / "sent")
        else:
            conn = SshConnector(dest, home=home, tag=box.alias)
        try:
            found = await bootstrap_remote.probe(conn, box.alias)
            return await bootstrap_remote.ensure_venv(conn, box.alias, found, rig.wheel_cache)
        finally:
            await conn.exit_master()
            await conn.close()

    return asyncio.run(go())


def test_a_wheel_changed_after_it_was_hashed_is_never_installed(remote: Remote) -> None:  # noqa: F811
    box = remote.boxes("w1")
    digest = _wheelhouse(box, remote.wheel_cache).digest
    with pytest.raises(ControllerError) as e:
        bootstrap(remote, box, tamper=True)
    said = str(e.value)
    assert "not the ones the controller hashed and sent" in said and "nothing was installed" in said
    assert "blake3-" in said and "sha256" in said, said
    venvs = box.home / ".boxwarden" / "venvs"
    assert not list(venvs.iterdir()), "no venv, not even a half-made one"
    assert not (box.home / ".boxwarden" / "wheels" / digest).exists()

    python = bootstrap(remote, box)  # the next up sends the true bytes, and installs them by hash
    assert python == f"{venvs}/{digest}/bin/python"
    pins = (venvs / digest / "boxwarden-requirements.txt").read_text().splitlines()
    house = _wheelhouse(box, remote.wheel_cache)
    assert len(pins) == len(house.wheels) - 1, "every wheel but pip's own, which is run, not installed"
    assert all(" --hash=sha256:" in line for line in pins), pins
    r = box.run_as_box([python, "-c", "import grpc, blake3, sidecar"])
    assert r.returncode == 0, r.stderr


def test_a_file_the_controller_did_not_send_stops_the_install(remote: Remote) -> None:  # noqa: F811
    box = remote.boxes("w2")
    digest = _wheelhouse(box, remote.wheel_cache).digest
    state = box.home / ".boxwarden"
    as_box(box, state, state / "wheels", state / "wheels" / digest, perm=0o700)
    box.write_file(f".boxwarden/wheels/{digest}/grpcio-99.0-py3-none-any.whl", "planted")
    with pytest.raises(ControllerError) as e:
        bootstrap(remote, box)
    said = str(e.value)
    assert "grpcio-99.0-py3-none-any.whl: a file the controller did not send" in said, said
    assert not list((state / "venvs").iterdir())
    bootstrap(remote, box)  # the directory went with the refusal: the next install is clean
    assert (state / "venvs" / digest / ".complete").exists()
