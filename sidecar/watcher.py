"""Watcher: the bridge from watchdog's inotify thread into the event loop.

The observer thread never touches sidecar state: each relevant event becomes a `FsChange` put on
an asyncio queue with `loop.call_soon_threadsafe`. Only events that can mean "a writer is done"
(close-after-write, rename into place) or "a claimed file left" (delete, rename away) are passed on;
modify events are noise (a 1 GiB save gives thousands).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FsChange:
    kind: Literal["done", "gone", "rescan"]
    path: Path


def _as_path(p: bytes | str) -> Path:
    return Path(p.decode("utf-8", "surrogateescape") if isinstance(p, bytes) else p)


class _Handler(FileSystemEventHandler):
    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[FsChange]) -> None:
        self._loop = loop
        self._queue = queue

    def _put(self, change: FsChange) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, change)

    def on_any_event(self, event: FileSystemEvent) -> None:
        if isinstance(event, FileClosedEvent | FileCreatedEvent):
            # Created: a file renamed or hard-linked in from outside the watched tree arrives with
            # no close event. Settling (and the open-for-write check) keeps early seals out.
            self._put(FsChange("done", _as_path(event.src_path)))
        elif isinstance(event, FileMovedEvent):
            self._put(FsChange("gone", _as_path(event.src_path)))
            self._put(FsChange("done", _as_path(event.dest_path)))
        elif isinstance(event, FileDeletedEvent):
            self._put(FsChange("gone", _as_path(event.src_path)))
        elif isinstance(event, DirMovedEvent | DirDeletedEvent | DirCreatedEvent):
            # A whole directory moved or vanished: cheaper and safer to rescan than to guess.
            self._put(FsChange("rescan", _as_path(event.src_path)))


class Watcher:
    """Recursive watches on every watched directory; `queue` receives the changes."""

    def __init__(self, roots: tuple[Path, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue[FsChange] = asyncio.Queue()
        self._observer = Observer()
        handler = _Handler(loop, self.queue)
        for root in roots:
            self._observer.schedule(handler, str(root), recursive=True)

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()

    def join(self, timeout: float = 5.0) -> None:
        self._observer.join(timeout)
