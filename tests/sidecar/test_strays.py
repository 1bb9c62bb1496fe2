"""strays.find against real processes: what ties a process outside every job to the workdir."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sidecar import proctree, strays
from tests.sidecar.test_openfiles import mapped, registered


def found(root: Path) -> dict[int, str]:
    table = proctree.scan()
    return {s.pid: s.why for s in strays.find(table, roots=[str(root)], exempt=set(), watched=[str(root)])}


def test_a_process_that_maps_a_file_there_and_closed_it_is_a_stray(tmp_path: Path) -> None:
    """Review 12: a process working in / that mapped a checkpoint and closed the fd held nothing
    /proc showed as open, so it was no stray; a read-only mapping counts too (mprotect can make
    it writable when the file was opened for writing)."""
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    target = root / "sub" / "w.bin"
    target.write_bytes(b"\0" * 4096)
    with mapped(target, "r", "private") as pid:
        assert found(root).get(pid) == f"maps {target} into memory"
    assert found(root) == {}


def test_a_process_running_a_program_from_the_workdir_is_a_stray(tmp_path: Path) -> None:
    """Review 11, finding 2: a process that works elsewhere but whose executable lies in the
    workdir (a tool from the project's tree, started with cwd /) was not a stray."""
    root = tmp_path / "work"
    root.mkdir()
    sleeper = root / "sleeper"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", sleeper)
    proc = subprocess.Popen([str(sleeper), "600"], cwd="/")
    try:
        assert found(root).get(proc.pid) == f"maps {sleeper} into memory"
    finally:
        proc.kill()
        proc.wait()
    assert not any(pid == proc.pid for pid in found(root))


def test_a_process_mapping_only_files_elsewhere_is_no_stray(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"\0" * 4096)
    with mapped(outside, "w", "shared") as pid:
        assert pid not in found(root)
    assert found(root) == {}


def test_a_process_holding_a_watched_dir_in_an_io_uring_is_a_stray(tmp_path: Path) -> None:
    """Review 12, F3: a process that registered the watched dir with an io_uring and closed its fd
    held nothing the scan read; after `down` it took an fd back (IORING_OP_FIXED_FD_INSTALL) and
    wrote a checkpoint there."""
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    for held in (root, root / "sub"):
        with registered(held, "d") as pid:
            assert found(root).get(pid) == f"holds {held} open through an io_uring"
    assert found(root) == {}
