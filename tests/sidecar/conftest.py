"""Fixtures for the sidecar's own tests."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Executor
from pathlib import Path

import pytest

from sidecar.ledger import Ledger
from sidecar.paths import ArtifactNamer
from sidecar.sealer import Sealer
from sidecar.storage import DurableStore
from tests.sidecar.daemon import short_dir


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with short_dir() as d:
        yield d


def make_sealer(
    watch: Path, ledger: Ledger, store: DurableStore, pool: Executor, settle_s: float = 0.01
) -> Sealer:
    """An in-process Sealer over one watched dir, its seals and scans on `pool` (no daemon)."""
    return Sealer(
        namer=ArtifactNamer((watch,)),
        ledger=ledger,
        store=store,
        executor=pool,
        scan_executor=pool,
        settle_s=settle_s,
        notify=lambda: None,
    )
