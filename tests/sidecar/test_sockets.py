"""A sidecar's socket is its own: two sidecars never share one path, and one that answers is never
unlinked (issue 25, finding 1: the second box's sidecar took over the first's live socket)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sidecar import sockets
from sidecar.errors import ConfigError


def listening(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    return s


def test_a_socket_that_answers_is_never_taken(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    other = listening(path)  # another box's sidecar (of an older version: it holds no lock)
    try:
        with pytest.raises(ConfigError, match="answers on the socket"):
            sockets.claim(path, tmp_path / "state")
        assert sockets.answers(path)  # still there, still answering
    finally:
        other.close()


def test_a_second_claim_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    first = sockets.claim(path, tmp_path / "a")
    try:
        with pytest.raises(ConfigError, match="another sidecar holds the socket"):
            sockets.claim(path, tmp_path / "b")
    finally:
        sockets.release(path, first)
    sockets.release(path, sockets.claim(path, tmp_path / "b"))  # free again once it let go


def test_a_dead_sidecars_socket_is_removed_and_anything_else_in_the_way_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    dead = listening(path)
    dead.close()  # the file stays, nothing answers
    assert path.exists() and not sockets.answers(path)
    sockets.release(path, sockets.claim(path, tmp_path / "state"))
    assert not path.exists()
    path.write_text("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        sockets.claim(path, tmp_path / "state")
    assert path.read_text() == "not a socket"
