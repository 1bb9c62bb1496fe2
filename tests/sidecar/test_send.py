"""`python -m sidecar.send`: the box-side half of a bulk pull, run as the real module in a child,
its stdout a pipe (as under sshd) or a file (as for a local box)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REFUSED = 3


def send(*args: str, stdout: int | None = None, timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar.send", *args],
        stdout=subprocess.PIPE if stdout is None else stdout,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def watch(tmp_path: Path) -> Path:
    w = tmp_path / "ckpt"
    (w / "cell-a").mkdir(parents=True)
    (w / "cell-a" / "big.bin").write_bytes(os.urandom(3 << 20))
    return w


def test_it_sends_exactly_the_range_asked_for_to_a_pipe(watch: Path) -> None:
    data = (watch / "cell-a" / "big.bin").read_bytes()
    whole = send("cell-a/big.bin", "0", str(len(data)), str(watch))
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout == data
    tail = send("cell-a/big.bin", "1000", str(len(data) - 1000), str(watch))
    assert tail.returncode == 0 and tail.stdout == data[1000:]
    middle = send("cell-a/big.bin", "5", "7", str(watch))
    assert middle.returncode == 0 and middle.stdout == data[5:12]


def test_it_writes_into_a_file_at_that_file_s_offset(watch: Path, tmp_path: Path) -> None:
    data = (watch / "cell-a" / "big.bin").read_bytes()
    part = tmp_path / "part"
    part.write_bytes(data[:4096])
    fd = os.open(part, os.O_RDWR)
    try:
        os.lseek(fd, 4096, os.SEEK_SET)
        r = send("cell-a/big.bin", "4096", str(len(data) - 4096), str(watch), stdout=fd)
    finally:
        os.close(fd)
    assert r.returncode == 0, r.stderr
    assert part.read_bytes() == data


def test_with_two_watched_dirs_the_path_starts_with_the_dir_s_name(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "ckpt", tmp_path / "b" / "logs"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    (b / "x.bin").write_bytes(b"from b")
    r = send("logs/x.bin", "0", "6", str(a), str(b))
    assert r.returncode == 0 and r.stdout == b"from b"
    missing = send("x.bin", "0", "6", str(a), str(b))  # without the prefix it names nothing
    assert missing.returncode == REFUSED


@pytest.mark.parametrize("case", ["missing", "escape", "symlinked-dir", "symlink", "fifo", "directory"])
def test_what_is_not_a_plain_file_under_a_watched_dir_is_refused(
    watch: Path, tmp_path: Path, case: str
) -> None:
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "key").write_bytes(b"do not send")
    if case == "symlinked-dir":
        (watch / "link").symlink_to(outside)
        art = "link/key"
    elif case == "symlink":
        (watch / "cell-a" / "key").symlink_to(outside / "key")
        art = "cell-a/key"
    elif case == "fifo":
        os.mkfifo(watch / "cell-a" / "pipe")  # a plain open() of it would wait for a writer forever
        art = "cell-a/pipe"
    elif case == "directory":
        art = "cell-a"
    else:
        art = {"missing": "cell-a/none.bin", "escape": "../secret/key"}[case]
    r = send(art, "0", "11", str(watch))
    assert r.returncode == REFUSED, r
    assert r.stdout == b"" and b"do not send" not in r.stdout
    assert r.stderr.strip(), "a refusal says why"


def test_a_file_shorter_than_asked_is_refused_after_what_it_holds(watch: Path) -> None:
    size = (watch / "cell-a" / "big.bin").stat().st_size
    r = send("cell-a/big.bin", "0", str(size + 10), str(watch))
    assert r.returncode == REFUSED
    assert len(r.stdout) == size
    assert b"holds" in r.stderr


@pytest.mark.parametrize(
    "args", [[], ["x"], ["x", "-1", "3", "/tmp"], ["x", "0", "ten", "/tmp"], ["x", "0", "1"]]
)
def test_bad_arguments_are_refused_and_never_exit_255(args: list[str]) -> None:
    r = send(*args)
    assert r.returncode == REFUSED  # 255 is ssh's own: a refusal must never read as a broken link
    assert b"usage" in r.stderr


def test_a_reader_that_goes_away_ends_the_sender(watch: Path) -> None:
    r_fd, w_fd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar.send", "cell-a/big.bin", "0", str(3 << 20), str(watch)],
        stdout=w_fd,
        stderr=subprocess.PIPE,
    )
    os.close(w_fd)
    assert os.read(r_fd, 1024)
    os.close(r_fd)  # the controller gave up
    assert proc.wait(timeout=30) == REFUSED
    assert proc.stderr is not None
    proc.stderr.close()
