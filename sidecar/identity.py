"""FileIdentity: what says "these are the same bytes as before" without reading them.

A file whose (device, inode, size, mtime_ns) is unchanged is not re-hashed after a restart; a file
whose identity changed between the start and the end of a read was being written during it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class FileIdentity:
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(dev=st.st_dev, ino=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)

    @classmethod
    def from_path(cls, path: Path) -> FileIdentity:
        """Identity of the file itself; a symlink is not followed (lstat)."""
        return cls.of(os.lstat(path))
