"""What watchdog 6.0 does otherwise than 7.1: 6.0 is the newest watchdog for Python 3.9 and 3.10.

Two differences matter to the watcher. 6.0 reports an attribute change as FileModifiedEvent (7
has FileAttribEvent): `ATTRIB_EVENTS` is empty there. And 6.0 drops the kernel's queue-overflow
event (IN_Q_OVERFLOW, wd -1) without a word, where 7.1 logs it and re-adds the watches of its
recursive trees (directories made while events were lost are watched too). On 6.x,
`report_overflow()` makes watchdog's inotify parser log the warning 7.1 logs, on the logger 7.1
logs it on, so the watcher learns of the loss the same way; the watcher then re-watches its roots
itself (`REBUILDS_WATCHES` is False). watchdog 7.0 has neither (it needs Python 3.11, where 7.1 is
there: pyproject.toml leaves 7.0 out).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import watchdog.events
from watchdog.events import FileSystemEvent
from watchdog.observers import inotify, inotify_c

ATTRIB_EVENTS: tuple[type[FileSystemEvent], ...] = (
    (watchdog.events.FileAttribEvent,) if hasattr(watchdog.events, "FileAttribEvent") else ()
)
REBUILDS_WATCHES = hasattr(inotify.InotifyEmitter, "on_queue_overflow")
OVERFLOW_WARNING = "Inotify queue overflowed; filesystem events were lost"  # 7.1's words

_IN_Q_OVERFLOW = 0x4000
_logger = logging.getLogger(inotify_c.__name__)


def report_overflow() -> None:
    """On watchdog 6.x, log OVERFLOW_WARNING whenever its parser meets the overflow event (it
    skips that event right after). Idempotent; nothing on a watchdog that reports it itself."""
    parser = getattr(inotify_c, "Inotify", None)  # 6.x; 7 reads its events elsewhere
    if REBUILDS_WATCHES or parser is None or getattr(parser._parse_event_buffer, "reports_overflow", False):
        return
    parse = parser._parse_event_buffer

    def parse_and_report(event_buffer: bytes) -> Iterator[tuple[int, int, int, bytes]]:
        for wd, mask, cookie, name in parse(event_buffer):
            if wd == -1 and mask & _IN_Q_OVERFLOW:
                _logger.warning(OVERFLOW_WARNING)
            yield wd, mask, cookie, name

    parse_and_report.reports_overflow = True  # type: ignore[attr-defined]
    parser._parse_event_buffer = staticmethod(parse_and_report)
