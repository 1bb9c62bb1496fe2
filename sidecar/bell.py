"""Bell: a broadcast "something changed" signal inside the event loop.

Streams take the current `ticket()` BEFORE they look at the state, then await it; a ring that
happens between their look and their wait is therefore never missed.
"""

from __future__ import annotations

import asyncio


class Bell:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def ring(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def ticket(self) -> asyncio.Event:
        return self._event
