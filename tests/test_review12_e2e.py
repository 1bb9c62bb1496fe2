"""Adversarial review 12 and the gap review 11 left: each test is a way the real CLI allowed
`down` wrongly before its fix (the findings are in issue 6's closing note)."""

from __future__ import annotations

from tests.conftest import Bw
from tests.sidecar.test_openfiles import mapped
from tests.test_review4_e2e import dry
from tests.test_review7_e2e import running_reasons, settled


def test_a_process_writing_a_checkpoint_through_a_mapping_holds_the_gate(bw: Bw) -> None:
    """A process outside every job (cwd /) mapped a sealed, pulled checkpoint MAP_SHARED and
    closed the fd: it can still write into it, but /proc showed no fd, and `down` was allowed."""
    p = settled(bw)
    target = p["watch"] / "a.bin"
    with mapped(target, "w", "shared") as pid:
        report = dry(bw)
        assert report["allowed"] is False
        # The scan sees the writer itself: no "cannot tell" that hangs on other processes.
        writes = [r for r in report["reasons"] if r["code"] == "UNSEALED_WRITES"]
        assert writes == [{"code": "UNSEALED_WRITES", "detail": "open for writing", "path": "a.bin"}]
        (reason,) = running_reasons(bw)
        assert f"pid {pid} " in reason["detail"] and f"maps {target} into memory" in reason["detail"]
    assert dry(bw)["allowed"] is True
