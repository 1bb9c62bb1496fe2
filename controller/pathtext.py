"""Paths the user gives as text: one rule for every command that takes one."""

from __future__ import annotations

import re
from pathlib import Path

from controller.errors import UsageError

CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check_path_text(path: Path | str, what: str) -> None:
    """Refuse control characters (a NUL, a newline, an escape) in a path the user gave, and names
    that are not UTF-8 (the box's config, the evidence and every message carry paths as text)."""
    text = str(path)
    if CONTROL.search(text):
        raise UsageError(f"{what} {text!r} contains a control character; give the path without it")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(
            f"{what} {text!r} is not valid UTF-8 (a name from another encoding); rename it, or give "
            "another path"
        ) from None
