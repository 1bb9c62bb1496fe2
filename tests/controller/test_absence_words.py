"""What ssh's words say of a box's host (controller.absence.reach_of): no link only for a
connection to the box's own address that could not be made, or a name with no address; "cannot
tell" for what this machine says when its own network is down; anything else answered."""

from __future__ import annotations

import pytest

from controller.absence import ANSWERS, CANNOT_TELL, NO_LINK, reach_of

HOST, PORT, DEST = "203.0.113.9", "2222", "gpu1"


@pytest.mark.parametrize(
    ("said", "kind"),
    [
        (f"ssh: connect to host {HOST} port {PORT}: Connection refused", NO_LINK),
        (f"ssh: connect to host {HOST} port {PORT}: Connection timed out", NO_LINK),
        (f"ssh: Could not resolve hostname {DEST}: Name or service not known", NO_LINK),
        (f"ssh: Could not resolve hostname {HOST}: Name or service not known", NO_LINK),  # its HostName
        ("ssh: Could not resolve hostname hop.example: Name or service not known", ANSWERS),
        # This machine's own network: no route out, its gateway silent, its resolver silent.
        (f"ssh: connect to host {HOST} port {PORT}: Network is unreachable", CANNOT_TELL),
        (f"ssh: connect to host {HOST} port {PORT}: No route to host", CANNOT_TELL),
        (f"ssh: Could not resolve hostname {DEST}: Temporary failure in name resolution", CANNOT_TELL),
        (f"ssh: Could not resolve hostname {HOST}: Temporary failure in name resolution", CANNOT_TELL),
        # Another address or port than the box's own: a hop, not the box.
        (f"ssh: connect to host 198.51.100.1 port {PORT}: Connection refused", ANSWERS),
        (f"ssh: connect to host {HOST} port 22: Connection refused", ANSWERS),
        ("Connection closed by 203.0.113.9 port 2222", ANSWERS),
    ],
)
def test_only_a_connection_never_made_to_the_box_counts(said: str, kind: str) -> None:
    assert reach_of(said, HOST, PORT, DEST) == kind
