"""Fields: one TOML table read with typed getters that remember what was read, so that anything
left over is reported as an unknown field; every error names the file and the field."""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controller.errors import UsageError


class Fields:
    """One TOML table being read: typed getters that remember what was read, so that anything left
    over is reported as an unknown field."""

    def __init__(self, data: Mapping[str, Any], where: str, file: str) -> None:
        self._data = data
        self._where = where
        self._file = file
        self._seen: set[str] = set()

    def fail(self, key: str, problem: str) -> UsageError:
        field = f"{self._where}.{key}" if self._where else key
        return UsageError(f"{self._file}: field {field}: {problem} (the schema is in profiles/README.md)")

    def _get(self, key: str, kind: type | tuple[type, ...], what: str, required: bool) -> Any:
        self._seen.add(key)
        if key not in self._data:
            if required:
                raise self.fail(key, f"missing; add {what}")
            return None
        value = self._data[key]
        # bool is an int in Python; a TOML boolean is never a number here.
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            raise self.fail(key, f"must be {what}, not {type(value).__name__} {value!r}")
        return value

    def text(self, key: str, *, required: bool = True, default: str = "") -> str:
        v = self._get(key, str, "a string", required)
        if v is not None and required and not v.strip():
            raise self.fail(key, "must not be empty")
        return default if v is None else str(v)

    def flag(self, key: str, *, required: bool = True, default: bool = False) -> bool:
        v = self._get(key, bool, "true or false", required)
        return default if v is None else bool(v)

    def integer(
        self, key: str, *, required: bool = True, default: int | None = None, minimum: int = 0
    ) -> int | None:
        v = self._get(key, int, "an integer", required)
        if v is None:
            return default
        if v < minimum:
            raise self.fail(key, f"must be at least {minimum}, not {v}")
        return int(v)

    def number(self, key: str, *, default: float, maximum: float) -> float:
        v = self._get(key, (int, float), "a number", False)
        if v is None:
            return default
        if not math.isfinite(v) or not 0 < v <= maximum:
            raise self.fail(key, f"must be a number above 0 and at most {maximum:g}, not {v}")
        return float(v)

    def texts(self, key: str, *, required: bool = False) -> tuple[str, ...]:
        v = self._get(key, list, "an array of strings", required)
        if v is None:
            return ()
        if not all(isinstance(x, str) and x for x in v):
            raise self.fail(key, "must be an array of non-empty strings")
        return tuple(v)

    def table(self, key: str) -> Fields:
        v = self._get(key, dict, f"a [{key}] table", True)
        return Fields(v, f"{self._where}.{key}" if self._where else key, self._file)

    def tables(self, key: str) -> list[Fields]:
        v = self._get(key, list, f"an array of [[{key}]] tables", False)
        if v is None:
            return []
        if not all(isinstance(x, dict) for x in v):
            raise self.fail(key, f"must be an array of [[{key}]] tables")
        return [Fields(x, f"{key}[{i}]", self._file) for i, x in enumerate(v)]

    def optional_table(self, key: str) -> Fields | None:
        return self.table(key) if key in self._data else None

    def done(self) -> None:
        unknown = sorted(set(self._data) - self._seen)
        if unknown:
            raise self.fail(unknown[0], "unknown field; remove it or check its spelling")


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def read_text(path: Path, *, what: str, option: str, max_bytes: int) -> str:
    """The UTF-8 text of a small regular file a user named (`what`: "the profile", "the queue
    file"; `option`: the flag that names it), checked on the open file before reading: a FIFO or
    /dev/zero would never end, a directory is not a file. Every problem is one UsageError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else str(e)
        raise UsageError(f"{path}: cannot read {what}: {why}") from e
    limit = f"{what} is at most {max_bytes >> 20} MiB, give the right file"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path}: not a regular file; give {option} a TOML file")
        if st.st_size > max_bytes:
            raise UsageError(f"{path}: {st.st_size} bytes; {limit}")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise UsageError(f"{path}: cannot read {what}: {e.strerror}") from e
    finally:
        os.close(fd)
    if size > max_bytes:
        raise UsageError(f"{path}: more than {max_bytes >> 20} MiB; {limit}")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start}); save {what} as UTF-8 TOML") from e
