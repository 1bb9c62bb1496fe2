"""Profiles: platform facts as data, shipped inside the wheel (package `boxwarden_profiles`).

This version knows how to run boxes of kind "local" only; the loader already reads and checks the
shipped file so that `up` refuses a profile it cannot honour instead of guessing.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from typing import Any

from controller.errors import UsageError


def available() -> list[str]:
    root = resources.files("boxwarden_profiles")
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def load(name: str) -> dict[str, Any]:
    if name not in available():
        raise UsageError(f"unknown profile {name!r}; available: {', '.join(available())}")
    text = resources.files("boxwarden_profiles").joinpath(f"{name}.toml").read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"profiles/{name}.toml: {e}") from e
    if not isinstance(data.get("kind"), str):
        raise UsageError(f'profiles/{name}.toml: field kind: missing (a string such as "local")')
    return data
