"""A burst of files waits in the sealer's queue, not as thousands of suspended seal tasks, and every
one of them is still sealed, pushed and proven (a real store and ledger)."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sidecar.ledger import Ledger
from sidecar.sealer import MAX_SEALING
from sidecar.storage.local import LocalStore
from tests.sidecar.conftest import make_sealer

N = 3 * MAX_SEALING + 7


def test_a_burst_is_queued_beyond_max_sealing_and_all_of_it_becomes_durable(tmp_path: Path) -> None:
    watch, durable = tmp_path / "watch", tmp_path / "durable"
    watch.mkdir()
    durable.mkdir()
    paths = []
    for i in range(N):
        p = watch / f"f{i:04d}.bin"
        p.write_bytes(os.urandom(64))
        paths.append(p)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    store = LocalStore(durable.resolve())

    async def scenario() -> None:
        with ThreadPoolExecutor(2) as ex:
            sealer = make_sealer(watch, ledger, store, ex)
            before = len(asyncio.all_tasks())
            for p in paths:
                sealer.candidate(p)
            assert len(asyncio.all_tasks()) - before <= MAX_SEALING  # the rest wait as entries
            assert len(sealer.busy_set()) == N  # and still count as busy (the gate waits for them)
            deadline = time.monotonic() + 120
            while ledger.counts.durable < N:
                assert time.monotonic() < deadline, f"{ledger.counts.durable} of {N} durable"
                await asyncio.sleep(0.05)
            while sealer.busy_set():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await sealer.close()

    try:
        asyncio.run(scenario())
    finally:
        ledger.close()
        store.close()
