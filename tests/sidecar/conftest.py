"""Fixtures for the sidecar's own tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sidecar.daemon import short_dir


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with short_dir() as d:
        yield d
