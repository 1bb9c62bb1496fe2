"""Which of ssh's words prove that no link reaches a box (controller.absence.unreachable): only a
connection to the box's own address that could not be made, or a name with no address; never what
this machine says when its own network is down."""

from __future__ import annotations

import pytest

from controller.absence import unreachable

HOST, PORT, DEST = "203.0.113.9", "2222", "gpu1"


@pytest.mark.parametrize(
    ("said", "gone"),
    [
        (f"ssh: connect to host {HOST} port {PORT}: Connection refused", True),
        (f"ssh: connect to host {HOST} port {PORT}: Connection timed out", True),
        (f"ssh: Could not resolve hostname {DEST}: Name or service not known", True),
        # This machine's own network: no route out, its gateway silent, its resolver silent.
        (f"ssh: connect to host {HOST} port {PORT}: Network is unreachable", False),
        (f"ssh: connect to host {HOST} port {PORT}: No route to host", False),
        (f"ssh: Could not resolve hostname {DEST}: Temporary failure in name resolution", False),
        # Another address or port than the box's own: a hop, not the box.
        (f"ssh: connect to host 198.51.100.1 port {PORT}: Connection refused", False),
        (f"ssh: connect to host {HOST} port 22: Connection refused", False),
        ("Connection closed by 203.0.113.9 port 2222", False),
    ],
)
def test_only_a_connection_never_made_to_the_box_counts(said: str, gone: bool) -> None:
    assert unreachable(said, HOST, PORT, DEST) is gone
