"""FileIdentity: what says "these are the same bytes as before" without reading them, and when
that answer can be trusted.

The identity is (device, inode, size, mtime_ns, ctime_ns). mtime alone is forgeable (`touch -r`,
`os.utime`), but ctime is set by the kernel on every write or metadata change and cannot be set
back by a user. Timestamps are coarse, though: the kernel stamps them from a clock that ticks every
few milliseconds, and some filesystems keep whole seconds only (ext4 with 128-byte inodes), so two
writes inside one tick leave the same identity. An identity is therefore trusted as a change
detector only once the file's ctime lies further in the past than the filesystem's granularity
(`is_racy`): any later write must then carry a later ctime. Within that window the sealer waits,
like git's "racily clean" rule. Write events from inotify are the second, independent detector.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sidecar.compat import SLOTS

COARSE_WINDOW_NS = 2_000_000_000
"""Racy window for a file whose timestamps are whole seconds (ext4 with 128-byte inodes: 1 s;
FAT-like: 2 s)."""

FINE_WINDOW_NS = 50_000_000
"""Racy window for nanosecond timestamps: they still come from the kernel's coarse clock, which
ticks every 1–10 ms (one jiffy)."""


@dataclass(frozen=True, **SLOTS)
class FileIdentity:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(
            dev=st.st_dev, ino=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns
        )

    def same_file(self, other: FileIdentity | None) -> bool:
        """The same inode (its bytes may have changed): None, or another inode, is another file."""
        return other is not None and self.dev == other.dev and self.ino == other.ino

    def matches(self, st: os.stat_result) -> bool:
        """`self == FileIdentity.of(st)` without building one (a listing compares 100,000)."""
        return (
            self.ctime_ns == st.st_ctime_ns
            and self.ino == st.st_ino
            and self.mtime_ns == st.st_mtime_ns
            and self.size == st.st_size
            and self.dev == st.st_dev
        )

    @classmethod
    def from_path(cls, path: Path) -> FileIdentity:
        """Identity of the file itself; a symlink is not followed (lstat)."""
        return cls.of(os.lstat(path))

    def racy_window_ns(self) -> int:
        """How long after its last change this file's identity cannot yet tell a new write apart.

        Nanosecond fields that are exact multiples of a second say the filesystem keeps whole
        seconds (a real nanosecond timestamp lands on .000000000 once in a billion)."""
        whole_seconds = self.ctime_ns % 1_000_000_000 == 0 and self.mtime_ns % 1_000_000_000 == 0
        return COARSE_WINDOW_NS if whole_seconds else FINE_WINDOW_NS

    def is_racy(self, now_ns: int) -> bool:
        """True if a write at `now_ns` could still leave this identity unchanged."""
        return now_ns < self.ctime_ns + self.racy_window_ns()
