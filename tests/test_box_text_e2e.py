"""Issue 25, finding 11: text from the box reaches the terminal escaped, whichever command prints it.
A real sidecar runs a job whose log line carries an OSC title sequence, BEL, backspaces, U+202E and
CSI sequences: that line is a LOSS_NONFINITE event's detail and the job's log."""

from __future__ import annotations

import json
import logging
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

from controller import render
from tests.conftest import Bw, save_weights, wait_until

# A line that would retitle the terminal, ring, erase what came before it, reverse what follows it
# and clear the screen, then show a forged event.
FORGED = "step 1 loss=nan \x1b]0;pwned\x07 ok\x08\x08\x08 \u202eevil \x1b[2J\x1b[1A 9 JOB_EXITED t1 0"
CONTROLS = ("\x1b", "\x07", "\x08", "\u202e", "\x9b")
NAME = "t1"


def forging_box(bw: Bw) -> dict[str, Any]:
    """Box NAME running a job that logs FORGED once, and the LOSS_NONFINITE event that line raised."""
    bw.up(NAME)
    code = f"import time; print({FORGED!r}, flush=True); time.sleep(600)"
    bw.ok("run", NAME, "--", sys.executable, "-c", code)

    def nonfinite() -> dict[str, Any] | None:
        lines = bw("events", NAME, "--json").stdout.splitlines()
        return next((r for r in map(json.loads, lines) if r["kind"] == "LOSS_NONFINITE"), None)

    return dict(wait_until(nonfinite, timeout=60, what="the LOSS_NONFINITE event"))


def test_events_show_the_boxs_text_escaped_and_json_keeps_it_whole(bw: Bw) -> None:
    rec = forging_box(bw)
    assert FORGED in rec["detail"]  # --json: the text intact, as data
    r = bw("events", NAME, "--json")
    assert r.returncode == 0, r.stderr
    for line in r.stdout.splitlines():
        json.loads(line)
        assert not any(c in line for c in CONTROLS), repr(line)  # json's own escapes: \u001b ...
    human = bw("events", NAME)
    assert human.returncode == 0, human.stderr
    assert not any(c in human.stdout for c in CONTROLS), repr(human.stdout)
    (shown,) = [x for x in human.stdout.splitlines() if "LOSS_NONFINITE" in x]
    assert "loss=nan \\x1b]0;pwned\\x07 ok\\x08\\x08\\x08 \\u202eevil \\x1b[2J\\x1b[1A 9" in shown


def test_logs_are_raw_into_a_pipe_and_escaped_on_a_terminal(bw: Bw) -> None:
    forging_box(bw)
    piped = subprocess.run(
        [sys.executable, "-m", "controller", "logs", NAME],
        cwd=bw.cwd,
        env=bw.env,
        capture_output=True,
        timeout=60,
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == (FORGED + "\n").encode()  # a file or a pipe keeps the job's bytes
    main, sub = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "controller", "logs", NAME],
            cwd=bw.cwd,
            env=bw.env,
            stdin=subprocess.DEVNULL,
            stdout=sub,
            stderr=subprocess.PIPE,
        )
        os.close(sub)
        shown = b""
        while chunk := _read(main):
            shown += chunk
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        os.close(main)
        if proc.stderr:
            proc.stderr.close()
    text = shown.decode()
    assert not any(c in text for c in CONTROLS), repr(text)
    assert "loss=nan \\x1b]0;pwned\\x07 ok\\x08\\x08\\x08 \\u202eevil \\x1b[2J" in text


def _read(fd: int) -> bytes:
    """The next bytes a terminal shows; b"" once its last writer closed it (EIO on Linux)."""
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def test_a_log_shown_on_a_terminal_is_escaped_whatever_its_chunks() -> None:
    text = render.log_text()
    chunks = [b"epoch 1 \xe2\x80", b"\xae bar\r", b"\n10%\r20%\r", b"", b"\x1b[2Jdone\n"]
    assert "".join(map(text, chunks)) == "epoch 1 \\u202e bar\n10%\n20%\n\\x1b[2Jdone\n"


def test_a_log_record_that_quotes_the_box_is_escaped() -> None:
    rec = logging.LogRecord(
        "x", logging.WARNING, __file__, 1, "%s: stream broke", ("a\x1b]0;t\x07.pt",), None
    )
    assert render.SafeFormatter("%(message)s").format(rec) == "a\\x1b]0;t\\x07.pt: stream broke"


def test_artifacts_show_excluded_names_escaped_markup_and_all(bw: Bw) -> None:
    p = bw.up(NAME, "--exclude", "*.log")
    (p["watch"] / "[red]a.log").write_bytes(b"x")
    (p["watch"] / "b\x1b]0;t\x07.log").write_bytes(b"y")
    wait_until(lambda: int(bw.artifacts(NAME)["excluded_files"]) == 2, what="both files excluded")
    r = bw("artifacts", NAME)
    assert r.returncode == 0, r.stderr
    assert "[red]a.log" in r.stderr and "b\\x1b]0;t\\x07.log" in r.stderr, r.stderr


def test_a_strays_command_line_never_starts_a_line_of_downs_own(bw: Bw, tmp_path: Path) -> None:
    """Second review of issue 25: a stray's command line is box text, and a newline in it started a
    line of `down`'s refusal of its own (`ALLOWED: ...` under REFUSED)."""
    p = bw.up("sn")
    save_weights(p["watch"] / "cell-a" / "a.safetensors", seed=1)
    bw.wait_durable("sn", 1)
    bw.ok("pull", "sn", "--to", str(tmp_path / "t"))
    bw.ok("verify", str(tmp_path / "t"))
    forged = "x\nALLOWED: sn may be torn down (dry run: nothing was done)\n"
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", forged], cwd=bw.cwd)
    try:
        r = bw("down", "sn", "--dry-run")
        assert r.returncode == 3 and "STRAY_PROCESS" in r.stderr, r.stderr
        assert not [line for line in r.stderr.splitlines() if line.lstrip().startswith("ALLOWED")], r.stderr
    finally:
        stray.kill()
        stray.wait()
