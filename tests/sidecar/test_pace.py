"""The push pace: bytes are paid for at the rate (with a small burst, no credit for idle time),
a drain lifts it at once (a push asleep in it wakes), and the stores pay for every byte they move."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from sidecar.config import from_message
from sidecar.errors import ConfigError
from sidecar.storage.local import LocalStore
from sidecar.storage.pace import BURST_S, DEFAULT_RATE, Pace
from tests.conftest import wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bytes_are_owed_at_the_rate_and_idle_time_earns_no_more_than_the_burst() -> None:
    clock = Clock()
    pace = Pace(1000, clock=clock)
    assert pace.owed(500) == pytest.approx(0.5 - BURST_S)  # a fresh pace allows the burst only
    assert pace.owed(500) == pytest.approx(1.0 - BURST_S)  # debts add up
    clock.now += 10  # long idle: the debt is gone, and no more than the burst is credited
    assert pace.owed(1000) == pytest.approx(1.0 - BURST_S)


def test_no_rate_means_no_wait() -> None:
    assert Pace(0).owed(10**12) == 0.0
    assert Pace(-1).owed(10**12) == 0.0


def test_a_lift_frees_the_pushes_at_once_and_leaves_no_debt_behind() -> None:
    clock = Clock()
    pace = Pace(1000, clock=clock)
    with pace.lifted():
        with pace.lifted():  # drains nest
            assert pace.owed(10**9) == 0.0
        assert pace.is_lifted and pace.owed(10**9) == 0.0
    assert not pace.is_lifted
    assert pace.owed(500) == pytest.approx(0.5)  # the drain's bytes are not owed afterwards


def test_an_ended_pace_never_waits_again_and_wakes_who_waits() -> None:
    pace = Pace(1)
    woke = threading.Event()
    t = threading.Thread(target=lambda: (pace.take(10**9), woke.set()), daemon=True)
    t.start()
    wait_until(lambda: pace.owed(0) > 1000, timeout=10, what="the push to owe its bytes")
    pace.end()
    wait_until(woke.is_set, timeout=10, what="the paced push to wake")
    with pace.lifted():
        pass
    assert pace.owed(10**9) == 0.0  # a lift ending does not bring the rate back


def test_a_push_asleep_in_the_pace_wakes_when_a_drain_lifts_it() -> None:
    pace = Pace(1)  # a gigabyte at one byte per second: asleep for good unless woken
    woke = threading.Event()

    def push() -> None:
        pace.take(10**9)
        woke.set()

    t = threading.Thread(target=push, daemon=True)
    t.start()
    wait_until(lambda: pace.owed(0) > 1000, timeout=10, what="the push to owe its bytes")
    assert not woke.is_set()
    with pace.lifted():
        wait_until(woke.is_set, timeout=10, what="the paced push to wake")
    t.join(timeout=10)
    assert not t.is_alive()


class Counting(Pace):
    def __init__(self) -> None:
        super().__init__(0)
        self.taken = 0
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            self.taken += n


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_stage_and_verify_pay_for_every_byte_they_move(tmp_path: Path, direct_io: bool) -> None:
    root = tmp_path / "store"
    root.mkdir()
    pace = Counting()
    store = LocalStore(root, direct_io=direct_io, chunk_size=1 << 20, pace=pace)
    src = tmp_path / "ckpt.bin"
    size = (5 << 20) + 123
    src.write_bytes(os.urandom(size))
    try:
        staged = store.stage(src, "ckpt.bin")
        assert pace.taken == size
        store.commit(staged)
        assert store.verify("ckpt.bin", staged.digest) == "reread"
        assert pace.taken == 2 * size
    finally:
        store.close()


def test_the_config_rate_defaults_and_a_negative_one_means_no_limit(tmp_path: Path) -> None:
    from boxwarden_pb.v1 import sidecar_pb2 as pb

    def settings(rate: int) -> float:
        (tmp_path / "w").mkdir(exist_ok=True)
        msg = pb.SidecarConfig(
            box_name="b",
            state_dir=str(tmp_path / "s"),
            socket_path=str(tmp_path / "s.sock"),
            watch_dirs=[str(tmp_path / "w")],
            durable_url=(tmp_path / "d").as_uri(),
            push_rate_bytes_s=rate,
        )
        return from_message(msg).push_rate

    assert settings(0) == DEFAULT_RATE
    assert settings(-1) == 0
    assert settings(250_000_000) == 250_000_000
    with pytest.raises(ConfigError, match="push_rate_bytes_s: 5 bytes/s"):
        settings(5)
