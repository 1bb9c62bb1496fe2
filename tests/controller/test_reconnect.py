"""SidecarClient.reconnect: calls that share one client and saw the same channel fail rebuild the
link once, not once each (four pulls in flight on a cut link)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from controller import client
from controller.client import SidecarClient
from controller.connector import LocalConnector


class Counting(LocalConnector):
    def __init__(self, socket: str) -> None:
        super().__init__(socket)
        self.resets = 0

    async def reset(self) -> None:
        self.resets += 1


def test_four_callers_of_one_failed_channel_rebuild_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "RECONNECT_BACKOFF_S", (0.0,))

    async def main() -> tuple[int, int]:
        conn = Counting(str(tmp_path / "sidecar.sock"))
        async with SidecarClient(conn=conn) as c:
            seen = c.generation
            await asyncio.gather(*(c.reconnect(seen) for _ in range(4)))
            after_one = conn.resets
            await c.reconnect(c.generation)  # a new failure of the new channel: rebuilt again
            return after_one, conn.resets

    assert asyncio.run(main()) == (1, 2)
