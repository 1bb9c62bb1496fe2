"""The controller's copy of a box's journal keeps each event once, in order, per box and run."""

from __future__ import annotations

from pathlib import Path

from controller.state import State


def test_each_event_is_kept_once_in_order_per_box_and_run(tmp_path: Path) -> None:
    state = State(tmp_path / "home")
    try:
        assert state.last_seq("b1", "r1") == 0
        assert [state.add_event("b1", "r1", n, n, {"seq": n}) for n in (1, 2, 3)] == [True, True, True]
        # A second follower of the same box receives 2 and 3 again: neither is kept twice.
        assert state.add_event("b1", "r1", 2, 2, {"seq": 2}) is False
        assert state.add_event("b1", "r1", 3, 3, {"seq": 3}) is False
        assert state.add_event("b1", "r1", 4, 4, {"seq": 4}) is True
        assert [e["seq"] for e in state.events("b1", "r1")] == [1, 2, 3, 4]
        assert [e["seq"] for e in state.events("b1", "r1", after=2)] == [3, 4]
        # Another run of the box (up after down) starts its own journal at 1.
        assert state.last_seq("b1", "r2") == 0 and state.add_event("b1", "r2", 1, 5, {"seq": 1}) is True
        assert state.last_seq("b1", "r1") == 4 and state.last_seq("b2", "r1") == 0
    finally:
        state.close()
