"""Watcher: the bridge from watchdog's inotify thread into the event loop.

The observer thread never touches sidecar state: each relevant event becomes a `FsChange` put on
an asyncio queue with `loop.call_soon_threadsafe`. "done": a writer may be finished (close after
write); "arrived": a file was created or renamed onto a path (a rename over a file replaces it in
one step); "gone": a file left (delete, rename away); "left": a directory left, with every file
under it; "blind": the kernel dropped events (any file may have changed unseen); "dirty": its bytes
or metadata changed (write, attribute change) — so a rewrite that keeps size and timestamps is still
noticed. A 1 GiB save gives thousands of writes: a path already reported dirty is not reported
again until the loop has taken the report (coalesced in this thread). Our own reads give no event
(the filter leaves out open and close-without-write).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
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
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import ObservedWatch

from sidecar import oldwatchdog
from sidecar.compat import SLOTS

logger = logging.getLogger(__name__)

# An attribute change is "dirty" too: FileAttribEvent on watchdog 7, FileModifiedEvent on 6.0.
_DIRTY: tuple[type[FileSystemEvent], ...] = (FileModifiedEvent, *oldwatchdog.ATTRIB_EVENTS)


@dataclass(frozen=True, **SLOTS)
class FsChange:
    kind: Literal["done", "arrived", "gone", "left", "rescan", "dirty", "blind"]
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
        if isinstance(event, _DIRTY):
            path = _as_path(event.src_path)
            with self._lock:
                if path in self._dirty_sent:
                    return
                self._dirty_sent.add(path)
            self._loop.call_soon_threadsafe(self._deliver_dirty, FsChange("dirty", path))
        elif isinstance(event, FileClosedEvent):
            self._put(FsChange("done", _as_path(event.src_path)))
        elif isinstance(event, FileCreatedEvent):
            # Created: a new file, or one renamed or hard-linked in from outside the watched tree
            # (no close event). Settling (and the open-for-write check) keeps early seals out.
            self._put(FsChange("arrived", _as_path(event.src_path)))
        elif isinstance(event, FileMovedEvent):
            self._put(FsChange("gone", _as_path(event.src_path)))
            self._put(FsChange("arrived", _as_path(event.dest_path)))
        elif isinstance(event, FileDeletedEvent):
            self._put(FsChange("gone", _as_path(event.src_path)))
        elif isinstance(event, (DirMovedEvent, DirDeletedEvent)):
            # Every file under it left with it, now: their claims end before anything new can take
            # their paths. Then a rescan finds where they went (a move inside the watched tree).
            self._put(FsChange("left", _as_path(event.src_path)))
            self._put(FsChange("rescan", _as_path(event.src_path)))
        elif isinstance(event, DirCreatedEvent):
            self._put(FsChange("rescan", _as_path(event.src_path)))


_WANTED: list[type[FileSystemEvent]] = [
    FileClosedEvent,
    FileCreatedEvent,
    FileMovedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    *oldwatchdog.ATTRIB_EVENTS,
    DirMovedEvent,
    DirDeletedEvent,
    DirCreatedEvent,
]


class _Overflow(logging.Handler):
    """watchdog handles a kernel queue overflow itself and passes no event on; it only logs it.
    Its log record is the one signal there is: it becomes a "blind" change (events were lost),
    after `rebuild` (on a watchdog that does not re-add its watches itself)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[FsChange],
        rebuild: Callable[[], None] | None,
    ) -> None:
        super().__init__(logging.WARNING)
        self._loop = loop
        self._queue = queue
        self._rebuild = rebuild

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in str(record.msg).lower():
            if self._rebuild is not None:
                self._loop.call_soon_threadsafe(self._rebuild)
            self._loop.call_soon_threadsafe(self._queue.put_nowait, FsChange("blind", Path("/")))


_WATCHDOG_LOGGERS = ("watchdog.observers.inotify_c", "watchdog.observers.inotify")


class Watcher:
    """Recursive watches on every watched directory; `queue` receives the changes."""

    def __init__(self, roots: tuple[Path, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue[FsChange] = asyncio.Queue()
        self._observer = Observer()
        self._handler = _Handler(loop, self.queue)
        self._overflow = _Overflow(loop, self.queue, None if oldwatchdog.REBUILDS_WATCHES else self._rebuild)
        self._watches: dict[Path, ObservedWatch] = {}
        for root in roots:
            self._watch(root)

    def _watch(self, root: Path) -> None:
        self._watches[root] = self._observer.schedule(
            self._handler, str(root), recursive=True, event_filter=_WANTED
        )

    def rewatch(self, root: Path) -> None:
        """The watched dir at `root` is another directory now (the old one was moved aside or
        deleted, and one made again): watch the new one, and stop reporting the old one's events
        under this name. Called on the loop."""
        old = self._watches.pop(root, None)
        if old is not None:
            with contextlib.suppress(KeyError):  # its emitter stopped itself at IN_DELETE_SELF
                self._observer.unschedule(old)
        try:
            self._watch(root)
        except OSError as e:  # not there (yet): the periodic rescan reports it and tries again
            logger.warning("cannot watch %s again: %s", root, e)

    def _rebuild(self) -> None:
        """Watch every root again after the kernel dropped events (watchdog 6.0; 7.1 does it
        itself): a directory made meanwhile has no watch of its own yet. Called on the loop."""
        for root in list(self._watches):
            self.rewatch(root)

    def start(self) -> None:
        oldwatchdog.report_overflow()
        for name in _WATCHDOG_LOGGERS:
            watchdog_log = logging.getLogger(name)
            watchdog_log.addHandler(self._overflow)
            # Its warnings are the overflow signal: a quieter --log-level must not silence them.
            if watchdog_log.getEffectiveLevel() > logging.WARNING:
                watchdog_log.setLevel(logging.WARNING)
        self._observer.start()

    def stop(self) -> None:
        self._observer.stop()
        for name in _WATCHDOG_LOGGERS:
            logging.getLogger(name).removeHandler(self._overflow)

    def join(self, timeout: float = 5.0) -> None:
        self._observer.join(timeout)
