"""A hostile user's inputs: each is refused at the edge with exit 2 and the fix (nothing created,
started or recorded), or behaves correctly: names and run ids, profile command templates, the meter
stop's process group, concurrent `down`s, paths that are files or carry control characters, profile
files that are not UTF-8 or not regular files, durable parents, symlinked tiers, a dead box's watched
dirs, terminal control characters, and the CLI's one error boundary."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import click
import pytest
from click.testing import CliRunner

from controller import bootstrap, checks, meterstop, profiles, render, templates
from controller.connector import LocalConnector
from controller.errors import UsageError
from controller.state import Box, State
from controller.tomlfields import Fields
from tests.conftest import REPO, Bw, pid_alive, wait_until
from tests.controller.test_meter_stop import (
    audit,
    calls,
    fake_profile,
    provider,
    pulled_and_verified,
    ready_box,
)

# -- helpers -----------------------------------------------------------------------------------------


def record(bw: Bw, name: str = "b1", **changes: Any) -> Box:
    """A box in the controller state as `up` leaves it, with no sidecar behind it (one that died)."""
    box_dir = bw.home / "boxes" / name
    box = Box(
        name=name,
        profile="local",
        box_dir=str(box_dir),
        state_dir=str(box_dir / "sidecar"),
        socket=str(bootstrap.socket_path_for(box_dir)),
        workdir=str(bw.cwd),
        watch=(str(bw.cwd / "ckpt"),),
        durable=(box_dir / "durable").as_uri(),
        run_id="r1",
    ).with_(**changes)
    state = State(bw.home)
    state.put(box)
    state.close()
    return box


def stored(bw: Bw, name: str = "b1") -> dict[str, Any] | None:
    if not (bw.home / "state.db").exists():
        return None
    db = sqlite3.connect(bw.home / "state.db")
    try:
        row = db.execute("SELECT record FROM boxes WHERE name = ?", (name,)).fetchone()
    finally:
        db.close()
    return json.loads(row[0]) if row else None


def up(bw: Bw, *extra: str, name: str = "b1") -> subprocess.CompletedProcess[str]:
    return bw("up", name, "--profile", "local", "--workdir", str(bw.cwd), *extra)


def refused(r: subprocess.CompletedProcess[str], *names: str) -> None:
    """Exit 2, one error naming each thing, no traceback."""
    assert r.returncode == 2, f"exit {r.returncode}:\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    for n in names:
        assert n in r.stderr, f"{n!r} not in {r.stderr!r}"


def nothing_started(bw: Bw, name: str = "b1") -> None:
    assert not [p for p in bw.sidecar_pids() if pid_alive(p)]
    assert stored(bw, name) is None


# -- 1. cells and run ids ----------------------------------------------------------------------------


@pytest.mark.parametrize("cell", ["../x", "a/b", ".hidden", "x" * 65, "a\nb"])
def test_run_refuses_a_cell_that_is_not_a_name(bw: Bw, cell: str) -> None:
    record(bw)
    r = bw("run", "b1", "--cell", cell, "--", "true")
    refused(r, "cell", "not allowed", "letters, digits")


@pytest.mark.parametrize("run_id", ["a\nb", "../up", "-x", "x" * 129, "a b"])
def test_up_refuses_a_run_id_that_is_not_an_id(bw: Bw, run_id: str) -> None:
    r = up(bw, "--watch", "ckpt", "--run-id", run_id)
    refused(r, "run id", "not allowed")
    nothing_started(bw)
    assert not (bw.cwd / "ckpt").exists()


# -- 2. profile command templates --------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ("python3", "-cprint(1)"),
        ("python3", "-Sc", "import os"),
        ("python3", "-u", "-Sc", "import os"),
        ("/usr/bin/python3.12", "-Ic", "1"),
        ("perl", "-E1"),
        ("perl", "-we", "1"),
        ("perl", "-Mstrict;system(1)"),
        ("ruby", "-e1"),
        ("node", "-p", "1"),
        ("node", "--eval=1"),
        ("node", "--print", "1"),
        ("php", "-r1;"),
        ("php", "-B", "1"),
        ("lua5.4", "-e", "os.exit()"),
        ("julia", "-E", "1"),
        ("osascript", "-e", "1"),
        ("awk", "BEGIN{exit 1}"),
        ("kubectl", "exec", "p", "--", "python3", "-c", "1"),
        ("kubectl", "exec", "p", "--", "bash", "-lc", "1"),
    ],
)
def test_templates_refuse_code_on_the_command_line_in_any_spelling(argv: tuple[str, ...]) -> None:
    with pytest.raises(UsageError, match=r"field meter_stop\.argv: (runs|passes)"):
        templates.check_template(argv, Fields({}, "meter_stop", "mine.toml"), "argv")


@pytest.mark.parametrize(
    "argv",
    [
        ("python3", "/opt/cloudctl.py", "delete", "{instance_id}"),
        ("python3", "-u", "-W", "ignore", "/opt/cloudctl.py"),
        ("node", "/opt/cli.js", "--region=eu"),
        ("cloudctl", "-c", "/etc/cloud.conf", "delete", "{instance_id}"),
        ("kubectl", "get", "node", "-ojsonpath={box}"),
    ],
)
def test_templates_still_take_plain_programs(argv: tuple[str, ...]) -> None:
    templates.check_template(argv, Fields({}, "meter_stop", "mine.toml"), "argv")


# -- 3. the meter stop kills its command's whole process group --------------------------------------


def test_a_meter_stop_command_that_times_out_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    # The command forks a grandchild that keeps the output pipe open, then waits forever itself.
    script = (
        "import os, sys, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(3600)\n"
        "    os._exit(0)\n"
        f"open({str(pid_file)!r}, 'w').write(str(pid))\n"
        "time.sleep(3600)\n"
    )
    try:
        # Bounded from outside too: before the fix, a grandchild holding the pipe hung this forever.
        ran = asyncio.run(
            asyncio.wait_for(meterstop.run_argv([sys.executable, "-c", script], timeout_s=3), timeout=60)
        )
        assert pid_file.exists(), "the command did not start its grandchild before the timeout"
        grandchild = int(pid_file.read_text())
        assert ran.ran is False and "was killed" in ran.stderr
        wait_until(lambda: not pid_alive(grandchild), timeout=10, what="the grandchild to be killed")
    finally:
        if pid_file.exists() and pid_alive(gc := int(pid_file.read_text())):
            os.kill(gc, signal.SIGKILL)


# -- 4. one `down` per box at a time -----------------------------------------------------------------


@contextlib.contextmanager
def held_down_lock(bw: Bw, name: str = "b1") -> Any:
    """Hold the box's `down` lock the way a running `down` does (this test's pid in the file)."""
    path = bw.home / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


@pytest.mark.parametrize("status", ["up", "meter-unproven"])
def test_a_second_down_fails_at_once_and_writes_no_audit(bw: Bw, status: str) -> None:
    before = record(bw, status=status)
    with held_down_lock(bw):
        r = bw("down", "b1", "--confirm", "b1")
    assert r.returncode == 1, r.stderr
    assert f"another `down b1` or an `up b1` is running (pid {os.getpid()}); wait for it" in r.stderr
    assert audit(bw) == []
    assert stored(bw) == json.loads(json.dumps(before.to_json()))


def test_two_real_downs_of_one_box(bw: Bw, tmp_path: Path) -> None:
    provider(bw, tmp_path, "create", "i-123", "--stuck")
    ready_box(bw, tmp_path, fake_profile(tmp_path, timeout_s=600))
    pulled_and_verified(bw)
    shown = calls(tmp_path).count(["show", "i-123"]) + 1  # (`up` asked once; `down` once before the release)
    first = bw.spawn("down", "fk1", "--confirm", "fk1")
    try:
        wait_until(
            lambda: calls(tmp_path).count(["show", "i-123"]) > shown, timeout=60, what="the first down's poll"
        )
        second = bw("down", "fk1", "--confirm", "fk1")
        assert second.returncode == 1, second.stderr
        assert f"another `down fk1` or an `up fk1` is running (pid {first.pid}); wait for it" in second.stderr
        assert audit(bw) == []  # the first one is still at work; the second wrote nothing
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 130
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    records = audit(bw)
    assert len(records) == 1 and "already" not in json.dumps(records)
    assert calls(tmp_path).count(["delete", "i-123"]) == 1


# -- 5. paths that cannot be directories, control characters, profile files -------------------------


def test_a_watch_path_that_is_a_file_is_refused(bw: Bw) -> None:
    (bw.cwd / "notes.txt").write_text("x")
    refused(up(bw, "--watch", "notes.txt"), str(bw.cwd / "notes.txt"), "not a directory")
    refused(up(bw, "--watch", "notes.txt/sub"), str(bw.cwd / "notes.txt"), "not a directory")
    nothing_started(bw)


def test_a_durable_url_naming_a_file_is_refused(bw: Bw, tmp_path: Path) -> None:
    f = tmp_path / "durable.txt"
    f.write_text("x")
    refused(up(bw, "--watch", "ckpt", "--durable", f.as_uri()), str(f), "not a directory")
    refused(up(bw, "--watch", "ckpt", "--durable", (f / "d").as_uri()), str(f), "not a directory")
    nothing_started(bw)
    assert not (bw.cwd / "ckpt").exists()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--durable", "file:///tmp/a%00b"),
        ("--durable", "file:///tmp/a%0Ab"),
        ("--durable", "file:///tmp/a\x1b[2Jb"),
        ("--watch", "ck\npt"),
        ("--watch", "ck\x9bpt"),
        ("--workdir", "w\rx"),
    ],
)
def test_control_characters_in_paths_are_refused(bw: Bw, flag: str, value: str) -> None:
    args = [flag, value] if flag == "--watch" else ["--watch", "ckpt", flag, value]
    r = bw("up", "b1", "--profile", "local", *args)
    refused(r, flag.removeprefix("--"), "control character")
    nothing_started(bw)


def test_a_profile_file_that_is_not_utf8_is_refused_at_up_and_at_down(bw: Bw, tmp_path: Path) -> None:
    bad = tmp_path / "mine.toml"
    bad.write_bytes(b'name = "mine"\ndescription = "caf\xe9"\n')
    r = bw("up", "b1", "--profile-file", str(bad), "--watch", "ckpt")
    refused(r, str(bad), "not UTF-8")
    nothing_started(bw)
    # `down` re-reads the file `up` accepted: one changed to Latin-1 since is refused the same way.
    record(bw, profile="mine", profile_file=str(bad))
    r = bw("down", "b1", "--dry-run")
    refused(r, str(bad), "not UTF-8")
    assert audit(bw) == []


def test_a_profile_file_that_is_not_a_regular_file_is_refused_before_reading(bw: Bw, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    big = tmp_path / "big.toml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    # The FIFO first: old code hangs on it (and times out) before ever reading /dev/zero without end.
    for path, why in [
        (str(fifo), "not a regular file"),
        (str(big), "1 MiB"),
        ("/dev/zero", "not a regular file"),
    ]:
        r = bw("up", "b1", "--profile-file", path, "--watch", "ckpt", timeout=30)
        refused(r, path, why)
    nothing_started(bw)


# -- 6. the controller never creates a durable volume's parent ---------------------------------------


def test_a_durable_dir_whose_parent_is_missing_is_refused_and_nothing_is_created(
    bw: Bw, tmp_path: Path
) -> None:
    parent = tmp_path / "unmounted"
    r = up(bw, "--watch", "ckpt", "--durable", (parent / "d").as_uri())
    refused(r, f"mount the durable volume (or create {parent}) first")
    assert not parent.exists()
    nothing_started(bw)
    assert not (bw.cwd / "ckpt").exists()


# -- 7. tiers are compared as resolved paths ---------------------------------------------------------


def box_resolve(request: dict[str, object], home: Path) -> dict[str, Any]:
    """The box-side `sidecar.launch resolve`, run as the box runs it, with `home` as the box's home."""
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": f"{REPO}:{REPO / 'proto'}"}
    out = subprocess.run(
        [sys.executable, "-m", "sidecar.launch", "resolve"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    return dict(json.loads(out.split("@@boxwarden-launch-begin@@")[1].split("@@boxwarden-launch-end@@")[0]))


def test_tiers_are_resolved_on_the_box_mount_and_home(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "d").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    home_link = tmp_path / "home"
    home_link.symlink_to(real)
    text = (Path(__file__).parent / "test_profiles.py").read_text()
    good = text[text.index('GOOD = """') + 10 : text.index('"""', text.index('GOOD = """') + 10)]
    f = tmp_path / "mine.toml"
    f.write_text(good.replace('path = "/data"', f"path = {json.dumps(str(link))}"))
    p = profiles.load_file(f)
    req = {
        "workdir": str(real),
        "watch": ["d"],
        "durable": str(link / "d" / "x"),
        "state_dir": str(tmp_path / "s"),
        "tiers": [t.path for t in p.storage],
    }
    facts = box_resolve({**req, "durable": str(tmp_path / "dur")}, tmp_path)
    (watched,) = facts["watch"]
    assert checks.tier_of(p, facts["real"][watched], facts["tiers"]) is p.storage[0]  # through the link
    f.write_text(good.replace('path = "/data"', 'path = "~/"'))
    home_p = profiles.load_file(f)
    facts = box_resolve({**req, "durable": str(tmp_path / "dur"), "tiers": ["~/"]}, home_link)
    assert checks.tier_of(home_p, facts["real"][watched], facts["tiers"]) is home_p.storage[0]
    findings = checks.watch_tier(p, [], str(real / "d"), {}, {p.storage[0].path: str(real)})
    assert findings[-1].level == "error" and "does NOT survive" in findings[-1].message


def test_a_durable_dir_reached_through_a_symlinked_tier_refuses_up(bw: Bw, tmp_path: Path) -> None:
    real = tmp_path / "scratch"
    real.mkdir()
    link = tmp_path / "ephemeral-mount"
    link.symlink_to(real)
    profile = fake_profile(tmp_path, watch_tier_path=str(link))  # the profile names the symlink
    args = ["--profile-file", str(profile), "--instance-id", "i-1", "--watch", "ckpt"]
    r = bw("up", "fk1", *args, "--durable", (real / "d").as_uri())
    assert r.returncode == 1, r.stderr
    assert "does NOT survive 'destroy'" in r.stderr and str(real / "d") in r.stderr
    assert not bw.sidecar_pids() and stored(bw, "fk1") is None


# -- 8. a box that was not torn down keeps its claims' dirs; a torn-down run id is not reused -------


def test_up_on_a_dead_box_refuses_other_watched_dirs_or_durable(bw: Bw, tmp_path: Path) -> None:
    before = record(bw)
    r = up(bw, "--watch", "other")
    refused(r, f"b1 watches {bw.cwd / 'ckpt'}; `down` it before watching other dirs")
    assert not (bw.cwd / "other").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = up(bw, "--watch", "ckpt", "--durable", elsewhere.as_uri())
    refused(r, f"b1 keeps its durable copies in {before.durable}; `down` it before changing --durable")
    r = up(bw, "--watch", "ckpt", "--run-id", "r2")
    refused(r, "b1 is running run r1; `down` it before starting run r2")
    assert stored(bw) == json.loads(json.dumps(before.to_json()))
    assert not [p for p in bw.sidecar_pids() if pid_alive(p)]


def test_up_refuses_the_run_id_of_a_torn_down_run(bw: Bw) -> None:
    before = record(bw, status="down", run_id="sweep-7")
    r = up(bw, "--watch", "ckpt", "--run-id", "sweep-7")
    refused(r, "run sweep-7 of b1 was torn down; pick a new run id")
    assert stored(bw) == json.loads(json.dumps(before.to_json()))
    assert not bw.sidecar_pids()


# -- 9. terminal safety ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("a\x9bb", "a\\x9bb"),
        ("\x1b[2J", "\\x1b[2J"),
        ("evil\u202etxt.pt", "evil\\u202etxt.pt"),
        ("\u2066x\u2069", "\\u2066x\\u2069"),
        ("a\rb\x07\x7f", "a\\x0db\\x07\\x7f"),
        ("line\nnext\tx", "line\\x0anext\\x09x"),
        ("ok-ünïcødé ✓", "ok-ünïcødé ✓"),
    ],
)
def test_safe_shows_terminal_controls_as_escapes(text: str, shown: str) -> None:
    assert render.safe(text) == shown
    assert render.safe("a\nb\tc\x9b", multiline=True) == "a\nb\tc\\x9b"


def test_untrusted_names_reach_the_terminal_escaped_and_json_exact(bw: Bw, tmp_path: Path) -> None:
    tree = tmp_path / "pulled\x9b\u202e"
    tree.mkdir()
    r = bw("verify", str(tree))
    assert r.returncode == 3
    assert "\x9b" not in r.stderr and "\u202e" not in r.stderr
    assert "pulled\\x9b\\u202e" in r.stderr
    doc = json.loads(bw("verify", str(tree), "--json").stdout)
    assert doc["root"] == str(tree)  # JSON stays exact


def test_a_profile_with_control_characters_is_shown_escaped(bw: Bw, tmp_path: Path) -> None:
    text = (Path(__file__).parent / "test_profiles.py").read_text()
    good = text[text.index('GOOD = """') + 10 : text.index('"""', text.index('GOOD = """') + 10)]
    f = tmp_path / "mine.toml"
    f.write_text(
        good.replace('description = "d"', 'description = "d\\u009b31m\\u202e"\ngotchas = ["g\\u001b]0;x"]')
    )
    r = bw("profiles", "show", "--profile-file", str(f))
    assert r.returncode == 0, r.stderr
    assert not any(ch in r.stderr for ch in "\x9b\u202e\x1b")
    assert "d\\x9b31m\\u202e" in r.stderr and "g\\x1b]0;x" in r.stderr


# -- 10. one error boundary --------------------------------------------------------------------------


def boundary_cli(exc: BaseException) -> click.Group:
    from controller.cli import BoundaryGroup

    @click.group(cls=BoundaryGroup)
    def g() -> None:
        pass

    @g.command("boom")
    def boom() -> None:
        raise exc

    return g


def test_an_unexpected_error_is_one_line_with_its_traceback_in_a_log(tmp_path: Path) -> None:
    home = tmp_path / "home"
    res = CliRunner().invoke(
        boundary_cli(ValueError("bad\nvalue")), ["boom"], env={"BOXWARDEN_HOME": str(home)}
    )
    assert res.exit_code == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: internal error: ValueError: bad value; details in "
    )
    log = Path(lines[0].split("details in ", 1)[1])
    assert log.parent == home / "logs" and (home / "logs").stat().st_mode & 0o777 == 0o700
    assert "Traceback" in log.read_text() and "ValueError: bad" in log.read_text()


def test_without_a_log_dir_the_error_is_still_one_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "logs").write_text("not a dir")
    res = CliRunner().invoke(boundary_cli(KeyError("k")), ["boom"], env={"BOXWARDEN_HOME": str(home)})
    assert res.exit_code == 1
    assert res.stderr.strip().splitlines() == ["error: internal error: KeyError: 'k'"]


def test_ctrl_c_is_exit_130_with_one_line(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        boundary_cli(KeyboardInterrupt()), ["boom"], env={"BOXWARDEN_HOME": str(tmp_path)}
    )
    assert res.exit_code == 130
    assert res.stderr.strip().splitlines() == ["error: interrupted"]


def test_clicks_own_errors_still_behave(bw: Bw) -> None:
    r = bw("up")
    assert r.returncode == 2 and "Missing argument 'NAME'" in r.stderr and "internal error" not in r.stderr
    r = bw("down", "b1", "--no-such-flag")
    assert r.returncode == 2 and "No such option" in r.stderr
    assert bw("--version").returncode == 0
    assert not (bw.home / "logs").exists()


def test_an_up_interrupted_as_its_sidecar_answers_leaves_no_sidecar_running(
    bw: Bw, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `up` stopped (Ctrl-C, an error) after it started a sidecar but before it recorded the
    box left that sidecar running, sealing, while the record still held an earlier teardown's
    steps ("sidecar seen gone"): a later `down` could continue that teardown without a gate."""
    box = record(bw)
    (bw.cwd / "ckpt").mkdir()
    real_hello = bootstrap.answering
    answered: list[int] = []

    async def hello_then_ctrl_c(conn: LocalConnector, timeout_s: float) -> Any:
        answer = await real_hello(conn, timeout_s=timeout_s)
        if answer is not None:
            answered.append(answer.pid)
            raise KeyboardInterrupt  # the user's Ctrl-C, the moment the new sidecar answers
        return answer

    monkeypatch.setattr(bootstrap, "answering", hello_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        durable = str(Path(unquote(urlsplit(box.durable).path)))
        asyncio.run(
            bootstrap.up(box, LocalConnector(box.socket), {"durable_dir": durable, "own_default": True})
        )
    (pid,) = answered
    assert not pid_alive(pid)


def test_paths_that_are_not_utf8_are_refused_in_one_line(bw: Bw, tmp_path: Path) -> None:
    """Review 17, F02: a Latin-1 directory name (legal on Linux) given to `up`, `pull --to` or
    `down --pulled` ended in two chained tracebacks: the box's config and the evidence
    carry paths as text, and the error boundary itself wrote argv as strict UTF-8."""
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9"))
    (odd / "ckpt").mkdir(parents=True)
    r = bw("up", "b1", "--profile", "local", "--workdir", str(odd), "--watch", "ckpt")
    assert r.returncode == 2 and "is not valid UTF-8" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not bw.sidecar_pids()
    bw.up("b1")
    for args in (
        ("pull", "b1", "--to", str(odd / "pulled")),
        ("down", "b1", "--dry-run", "--pulled", str(odd)),
    ):
        r = bw(*args)
        assert r.returncode == 2 and "is not valid UTF-8" in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
    assert not (odd / "pulled").exists()


def test_the_error_boundary_survives_an_argument_that_is_not_utf8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from controller.cli import _internal_error

    monkeypatch.setenv("BOXWARDEN_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["boxwarden", "pull", "b1", "--to", os.fsdecode(b"caf\xe9")])
    line = _internal_error(RuntimeError("boom"))
    assert line.startswith("internal error: RuntimeError: boom; details in ")
    (log,) = (tmp_path / "logs").iterdir()
    assert "--to caf\\udce9" in log.read_text()
