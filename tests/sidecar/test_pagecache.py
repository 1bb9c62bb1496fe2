"""sidecar.storage.pagecache, and how the file:// verify uses it: a re-read through the page cache
counts as proof only when nothing of the copy was cached and the whole copy came from storage."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.storage import local, pagecache
from sidecar.storage.local import WRITE_BEHIND, LocalStore

PAGE = mmap.PAGESIZE


def dropped(path: Path) -> int:
    """Open `path`, flush and drop it from the page cache; the caller closes the fd."""
    fd = os.open(path, os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd


def test_resident_pages_sees_a_read_and_a_drop(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(4 << 20))
    fd = dropped(path)
    try:
        assert pagecache.resident_pages(fd, 4 << 20) == 0
        os.pread(fd, PAGE, 0)
        assert (pagecache.resident_pages(fd, 4 << 20) or 0) >= 1
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert pagecache.resident_pages(fd, 4 << 20) == 0
        assert pagecache.resident_pages(fd, 0) == 0
    finally:
        os.close(fd)


def test_thread_read_bytes_counts_reads_from_storage_only(tmp_path: Path) -> None:
    size = 8 << 20
    path = tmp_path / "f"
    path.write_bytes(os.urandom(size))
    fd = dropped(path)
    try:
        before = pagecache.thread_read_bytes()
        assert before is not None, "this kernel keeps per-task I/O accounting (the verify relies on it)"
        while os.read(fd, 1 << 20):
            pass
        after = pagecache.thread_read_bytes()
        assert after is not None and after - before >= size
        os.lseek(fd, 0, os.SEEK_SET)
        while os.read(fd, 1 << 20):  # now from the page cache: nothing fetched
            pass
        assert pagecache.thread_read_bytes() == after
    finally:
        os.close(fd)


def test_write_out_with_wait_leaves_clean_pages_that_a_drop_removes(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, os.urandom(2 << 20))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # starts writeback; dirty pages stay
        assert pagecache.write_out(fd, 0, 2 << 20, wait=True)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert pagecache.resident_pages(fd, 2 << 20) == 0
    finally:
        os.close(fd)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    root = tmp_path / "durable"
    root.mkdir()
    s = LocalStore(root)  # the default: copies and re-reads through the page cache
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def direct_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the verify's O_DIRECT re-reads (the fallback when the page cache cannot prove)."""
    calls: list[int] = []
    real = local.hash_direct

    def spy(fd: int, pool: object, pace: object) -> str:
        calls.append(fd)
        return real(fd, pool, pace)  # type: ignore[arg-type]

    monkeypatch.setattr(local, "hash_direct", spy)
    return calls


def pushed(store: LocalStore, tmp_path: Path, size: int = 6 << 20) -> str:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(size))
    staged = store.stage(src, "ckpt.bin")
    store.commit(staged)
    return staged.digest


def test_verify_through_the_page_cache_proves_without_an_o_direct_read(
    store: LocalStore, tmp_path: Path, direct_reads: list[int]
) -> None:
    digest = pushed(store, tmp_path)
    assert store.verify("ckpt.bin", digest) == "reread"
    assert direct_reads == []
    fd = os.open(store.root / "ckpt.bin", os.O_RDONLY)
    try:
        assert pagecache.resident_pages(fd, 6 << 20) == 0  # and leaves nothing cached
    finally:
        os.close(fd)


def test_a_page_that_stays_cached_sends_the_verify_to_o_direct(
    store: LocalStore, tmp_path: Path, direct_reads: list[int]
) -> None:
    """A mapped page survives the verify's drop: a re-read through the cache would hash that page,
    not the device's, so the verify reads the copy again with O_DIRECT."""
    digest = pushed(store, tmp_path)
    with open(store.root / "ckpt.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[PAGE * 3] is not None  # fault one page in; the mapping keeps it
        assert store.verify("ckpt.bin", digest) == "reread"
    assert len(direct_reads) == 1


def test_a_reread_not_shown_to_come_from_storage_is_done_again_with_o_direct(
    store: LocalStore, tmp_path: Path, direct_reads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No per-task accounting (or someone else fetched the pages first): not proven that way."""
    digest = pushed(store, tmp_path)
    monkeypatch.setattr(local, "thread_read_bytes", lambda: None)
    assert store.verify("ckpt.bin", digest) == "reread"
    assert len(direct_reads) == 1
    readings = iter([100, 100 + (1 << 20)])  # only 1 MiB of the 6 fetched
    monkeypatch.setattr(local, "thread_read_bytes", lambda: next(readings))
    assert store.verify("ckpt.bin", digest) == "reread"
    assert len(direct_reads) == 2


def test_verify_through_the_page_cache_catches_a_changed_copy(store: LocalStore, tmp_path: Path) -> None:
    digest = pushed(store, tmp_path)
    with open(store.root / "ckpt.bin", "r+b") as f:
        f.seek(5 << 20)
        f.write(b"\0")
    assert store.verify("ckpt.bin", digest) is None


def test_stage_writes_behind_and_keeps_little_of_the_copy_in_memory(
    store: LocalStore, tmp_path: Path
) -> None:
    size = 96 << 20
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(size))
    staged = store.stage(src, "big.bin")
    try:
        tmp = staged.handle
        assert isinstance(tmp, Path)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            resident = pagecache.resident_pages(fd, size)
        finally:
            os.close(fd)
        # What is more than WRITE_BEHIND behind the last write went to the device and was dropped.
        assert resident is not None and resident * PAGE <= 2 * WRITE_BEHIND + 3 * (8 << 20)
    finally:
        store.discard(staged)


def test_a_cached_page_alone_sends_the_verify_to_o_direct(
    store: LocalStore, tmp_path: Path, direct_reads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even where the read accounting would say every byte was fetched (it counts bytes, not
    pages), a page cached before the read means the re-read is not proof."""
    digest = pushed(store, tmp_path)
    counter = iter(range(0, 1 << 62, 1 << 40))
    monkeypatch.setattr(local, "thread_read_bytes", lambda: next(counter))  # always "all fetched"
    with open(store.root / "ckpt.bin", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[PAGE] is not None
        assert store.verify("ckpt.bin", digest) == "reread"
    assert len(direct_reads) == 1


def test_the_unproven_digest_is_never_the_answer_where_o_direct_can_read(
    store: LocalStore, tmp_path: Path, direct_reads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    digest = pushed(store, tmp_path)
    monkeypatch.setattr(local, "thread_read_bytes", lambda: 0)  # nothing ever "fetched"
    monkeypatch.setattr(local, "hash_by_read", lambda fd, pace: "0" * 64)  # and a wrong digest
    assert store.verify("ckpt.bin", digest) == "reread"  # O_DIRECT's digest decided
    assert len(direct_reads) == 1


def test_a_proven_reread_needs_no_o_direct_read(
    store: LocalStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digest = pushed(store, tmp_path)

    def refused(fd: int, pool: object, pace: object) -> str:
        raise AssertionError("O_DIRECT re-read of a proven copy")

    monkeypatch.setattr(local, "hash_direct", refused)
    assert store.verify("ckpt.bin", digest) == "reread"


def test_a_copy_written_during_the_reread_is_read_again_with_o_direct(
    store: LocalStore, tmp_path: Path, direct_reads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone writes the copy while the verify reads it (cached bytes that never reached the
    device could then be hashed): the size or times moved, so the read is not proof."""
    digest = pushed(store, tmp_path)
    real = local.hash_by_read

    def meddling(fd: int, pace: object) -> str:
        out = real(fd, pace)  # type: ignore[arg-type]
        with open(store.root / "ckpt.bin", "r+b") as f:  # the same bytes, written again
            head = f.read(PAGE)
            f.seek(0)
            f.write(head)
        return out

    monkeypatch.setattr(local, "hash_by_read", meddling)
    assert store.verify("ckpt.bin", digest) == "reread"
    assert len(direct_reads) == 1


def test_a_filesystem_that_cannot_show_where_reads_come_from_is_always_read_with_o_direct(
    store: LocalStore, tmp_path: Path, direct_reads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    digest = pushed(store, tmp_path)
    asked: list[int] = []
    monkeypatch.setattr(local, "provable_fs", lambda fd: asked.append(fd))  # None: ZFS, NFS, FUSE...
    assert store.verify("ckpt.bin", digest) == "reread"
    assert store.verify("ckpt.bin", digest) == "reread"
    assert len(direct_reads) == 2 and len(asked) == 1  # learnt once for the store


def test_provable_fs_names_this_disk_and_refuses_tmpfs(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert pagecache.provable_fs(fd) in ("ext2/3/4", "xfs", "btrfs")
    finally:
        os.close(fd)
    fd = os.open("/dev/shm", os.O_RDONLY)
    try:
        assert pagecache.provable_fs(fd) is None
    finally:
        os.close(fd)
