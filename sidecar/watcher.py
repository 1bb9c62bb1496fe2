"""Watcher: the bridge from watchdog's inotify thread into the event loop.

The observer thread never touches sidecar state: each relevant event becomes a `FsChange` put on
an asyncio queue with `loop.call_soon_threadsafe`. "done": a writer may be finished (close after
write, rename into place); "gone": a file left (delete, rename away); "dirty": its bytes or
metadata changed (write, attribute change) — so a rewrite that keeps size and timestamps is still
noticed. A 1 GiB save gives thousands of writes: a path already reported dirty is not reported
again until the loop has taken the report (coalesced in this thread). Our own reads give no event
(the filter leaves out open and close-without-write).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileAttribEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FsChange:
    kind: Literal["done", "gone", "rescan", "dirty"]
    path: Path


def _as_path(p: bytes | str) -> Path:
    return Path(p.decode("utf-8", "surrogateescape") if isinstance(p, bytes) else p)


class _Handler(FileSystemEventHandler):
    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[FsChange]) -> None:
        self._loop = loop
        self._queue = queue
        self._dirty_sent: set[Path] = set()
        self._lock = threading.Lock()

    def _put(self, change: FsChange) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, change)

    def _deliver_dirty(self, change: FsChange) -> None:  # on the loop
        with self._lock:
            self._dirty_sent.discard(change.path)
        self._queue.put_nowait(change)

    def on_any_event(self, event: FileSystemEvent) -> None:
        if isinstance(event, FileModifiedEvent | FileAttribEvent):
            path = _as_path(event.src_path)
            with self._lock:
                if path in self._dirty_sent:
                    return
                self._dirty_sent.add(path)
            self._loop.call_soon_threadsafe(self._deliver_dirty, FsChange("dirty", path))
        elif isinstance(event, FileClosedEvent | FileCreatedEvent):
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
        wanted = [
            FileClosedEvent,
            FileCreatedEvent,
            FileMovedEvent,
            FileDeletedEvent,
            FileModifiedEvent,
            FileAttribEvent,
            DirMovedEvent,
            DirDeletedEvent,
            DirCreatedEvent,
        ]
        for root in roots:
            self._observer.schedule(handler, str(root), recursive=True, event_filter=wanted)

    def start(self) -> None:
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()

    def join(self, timeout: float = 5.0) -> None:
        self._observer.join(timeout)
