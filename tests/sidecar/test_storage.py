"""sidecar.storage (file://) and sidecar.hashing against real files, a real b3sum and a real tmpfs."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sidecar import hashing
from sidecar.errors import ChangedError, ConfigError, PreconditionError, StorageError, UnsafePathError
from sidecar.hashing import MMAP_THRESHOLD, hash_file, hash_file_read, is_digest, new_hasher
from sidecar.storage import ID_NAME, TMP_DIRNAME, StagedCopy, fsio, local, open_store
from sidecar.storage.local import LocalStore

EMPTY_DIGEST = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
SMALL_CHUNK = 4096
SMALL_DIRECT = 64 << 10  # hash_direct's read size in tests: many reads out of a small file

needs_b3sum = pytest.mark.skipif(shutil.which("b3sum") is None, reason="b3sum is not installed")


def b3sum(path: Path) -> str:
    return subprocess.run(
        ["b3sum", "--no-names", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()


def write_random(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def temps(root: Path) -> list[str]:
    tmp = root / TMP_DIRNAME
    return sorted(os.listdir(tmp)) if tmp.exists() else []


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalStore]:
    root = tmp_path / "durable"
    root.mkdir()
    s = LocalStore(root.resolve(), direct_io=request.param, chunk_size=SMALL_CHUNK * 64)
    try:
        yield s
    finally:
        s.close()


def push(store: LocalStore, src: Path, rel: str) -> StagedCopy:
    staged = store.stage(src, rel)
    store.commit(staged)
    return staged


# ------------------------------------------------------------------------------------- hashing


@needs_b3sum
@pytest.mark.parametrize("size", [0, 1, 4097, MMAP_THRESHOLD - 1, MMAP_THRESHOLD, MMAP_THRESHOLD + 12345])
def test_hash_file_matches_b3sum(tmp_path: Path, size: int) -> None:
    src = write_random(tmp_path / "f", size)
    digest = hash_file(src)
    assert digest == b3sum(src) == hash_file_read(src)
    assert is_digest(digest)


def test_streaming_hasher_matches_hash_file(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 7)
    src = tmp_path / "f"
    src.write_bytes(data)
    for update_size in (0, 1 << 20):
        h = new_hasher(update_size=update_size)
        for i in range(0, len(data), 1 << 20):
            h.update(data[i : i + (1 << 20)])
        assert h.hexdigest() == hash_file(src)


def test_is_digest_shape() -> None:
    assert is_digest(EMPTY_DIGEST)
    assert not is_digest(EMPTY_DIGEST.upper())
    assert not is_digest(EMPTY_DIGEST[:-1])


# ---------------------------------------------------------------------------- stage/commit/verify


@needs_b3sum
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, (1 << 20) + 17, 3 * SMALL_CHUNK * 64 + 5])
def test_round_trip(store: LocalStore, tmp_path: Path, size: int) -> None:
    src = write_random(tmp_path / "ckpt.bin", size)
    staged = store.stage(src, "run-1/ckpt.bin")
    assert staged.size == size
    assert staged.digest == hash_file(src) == b3sum(src)
    assert isinstance(staged.handle, Path) and staged.handle.exists()  # a file store: its temp copy
    assert not store.exists("run-1/ckpt.bin")

    store.commit(staged)

    final = store.root / "run-1" / "ckpt.bin"
    assert final.read_bytes() == src.read_bytes()
    assert b3sum(final) == staged.digest
    assert store.exists("run-1/ckpt.bin")
    assert store.verify("run-1/ckpt.bin", staged.digest)
    assert temps(store.root) == []


def test_empty_file(store: LocalStore, tmp_path: Path) -> None:
    src = tmp_path / "empty"
    src.touch()
    staged = push(store, src, "empty")
    assert staged.digest == EMPTY_DIGEST
    assert staged.size == 0
    assert store.verify("empty", EMPTY_DIGEST)


def test_nested_rel_creates_directories(store: LocalStore, tmp_path: Path) -> None:
    src = write_random(tmp_path / "x", 10_000)
    staged = push(store, src, "a/b/c/d.bin")
    assert (store.root / "a" / "b" / "c" / "d.bin").is_file()
    assert store.verify("a/b/c/d.bin", staged.digest)
    # a second artifact in an existing directory, and a re-push over an existing copy
    push(store, src, "a/b/other.bin")
    write_random(src, 5_000)
    again = push(store, src, "a/b/c/d.bin")
    assert again.digest != staged.digest
    assert store.verify("a/b/c/d.bin", again.digest)
    assert not store.verify("a/b/c/d.bin", staged.digest)


def test_corrupted_copy_fails_verify(store: LocalStore, tmp_path: Path) -> None:
    src = write_random(tmp_path / "x", (1 << 20) + 100)
    staged = push(store, src, "ckpt.bin")
    final = store.root / "ckpt.bin"
    with open(final, "r+b") as f:
        f.seek(777_777)
        byte = f.read(1)
        f.seek(777_777)
        f.write(bytes([byte[0] ^ 0x01]))
    assert not store.verify("ckpt.bin", staged.digest)


def test_truncated_and_missing_copies_fail_verify(store: LocalStore, tmp_path: Path) -> None:
    src = write_random(tmp_path / "x", 50_000)
    staged = push(store, src, "d/ckpt.bin")
    os.truncate(store.root / "d" / "ckpt.bin", 49_999)
    assert not store.verify("d/ckpt.bin", staged.digest)
    assert not store.verify("d/never.bin", staged.digest)
    assert not store.verify("nowhere/ckpt.bin", staged.digest)
    assert not store.verify("d/ckpt.bin/below-a-file", staged.digest)
    assert not store.verify("d", staged.digest)  # a directory is not a copy
    assert not store.exists("d")


def test_concurrent_stages_do_not_mix(store: LocalStore, tmp_path: Path) -> None:
    srcs = [write_random(tmp_path / f"s{i}", (1 << 20) + 4096 * i + i) for i in range(4)]
    results: dict[int, StagedCopy] = {}

    def work(i: int) -> None:
        results[i] = push(store, srcs[i], f"c/{i}.bin")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, src in enumerate(srcs):
        assert results[i].digest == hash_file(src)
        assert store.verify(f"c/{i}.bin", results[i].digest)


def test_progress_reports_bytes(store: LocalStore, tmp_path: Path) -> None:
    size = 3 * SMALL_CHUNK * 64 + 5
    src = write_random(tmp_path / "x", size)
    seen: list[int] = []
    store.stage(src, "p", progress=seen.append)
    assert seen == sorted(seen)
    assert seen[-1] == size
    assert len(seen) == 4


# --------------------------------------------------------------------------- a source that changes


def _append(src: Path) -> None:
    with open(src, "ab") as f:
        f.write(b"more")


def _truncate(src: Path) -> None:
    os.truncate(src, 10)


def _replace(src: Path) -> None:
    new = src.with_name("replacement")
    new.write_bytes(b"x" * src.stat().st_size)
    os.replace(new, src)


@pytest.mark.parametrize("change", [_append, _truncate, _replace], ids=["append", "truncate", "replace"])
def test_source_changed_during_stage(
    store: LocalStore, tmp_path: Path, change: Callable[[Path], None]
) -> None:
    src = write_random(tmp_path / "x", 4 * SMALL_CHUNK * 64)
    calls: list[int] = []

    def on_progress(n: int) -> None:
        # The writer strikes after the first chunk was read: deterministic, no timing involved.
        if not calls:
            change(src)
        calls.append(n)

    with pytest.raises(ChangedError, match="changed while it was copied"):
        store.stage(src, "x", progress=on_progress)
    assert temps(store.root) == []
    assert not store.exists("x")


def test_source_vanished(store: LocalStore, tmp_path: Path) -> None:
    with pytest.raises(ChangedError, match="vanished"):
        store.stage(tmp_path / "gone", "x")


def test_fifo_source_is_refused_without_blocking(store: LocalStore, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PreconditionError, match="not a regular file"):
        store.stage(fifo, "x")
    assert temps(store.root) == []


def test_symlink_source_is_refused(store: LocalStore, tmp_path: Path) -> None:
    target = write_random(tmp_path / "target", 100)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(PreconditionError):
        store.stage(link, "x")


def test_progress_error_leaves_no_temp(store: LocalStore, tmp_path: Path) -> None:
    src = write_random(tmp_path / "x", 3 * SMALL_CHUNK * 64)

    def boom(n: int) -> None:
        raise RuntimeError("caller gave up")

    with pytest.raises(RuntimeError, match="caller gave up"):
        store.stage(src, "x", progress=boom)
    assert temps(store.root) == []


# ------------------------------------------------------------------------------------ unsafe rels

UNSAFE = [
    *("", "/abs", "../x", "a/../../x", "a//b", "a/./b", ".", "a/", "a\x00b", "a/.."),
    *(f"{TMP_DIRNAME}/x", ID_NAME),
]


@pytest.mark.parametrize("rel", UNSAFE)
def test_unsafe_rel_is_refused_everywhere(store: LocalStore, tmp_path: Path, rel: str) -> None:
    src = write_random(tmp_path / "x", 10)
    with pytest.raises(UnsafePathError):
        store.stage(src, rel)
    with pytest.raises(UnsafePathError):
        store.verify(rel, EMPTY_DIGEST)
    with pytest.raises(UnsafePathError):
        store.exists(rel)
    assert temps(store.root) == []


def test_symlinked_directory_under_root_is_refused(store: LocalStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.root / "escape").symlink_to(outside)
    src = write_random(tmp_path / "x", 10)
    staged = store.stage(src, "escape/x")
    with pytest.raises(UnsafePathError, match="symlink"):
        store.commit(staged)
    assert list(outside.iterdir()) == []
    assert temps(store.root) == []
    with pytest.raises(UnsafePathError, match="symlink"):
        store.verify("escape/x", staged.digest)


def test_symlink_at_final_name_is_refused(store: LocalStore, tmp_path: Path) -> None:
    victim = write_random(tmp_path / "victim", 10)
    (store.root / "ckpt").symlink_to(victim)
    staged = store.stage(write_random(tmp_path / "x", 10), "ckpt")
    with pytest.raises(UnsafePathError, match="symlink"):
        store.commit(staged)
    assert (store.root / "ckpt").is_symlink()
    assert temps(store.root) == []


# --------------------------------------------------------------------------------- temp lifecycle


def test_discard_and_commit_after_discard(store: LocalStore, tmp_path: Path) -> None:
    staged = store.stage(write_random(tmp_path / "x", 10), "x")
    store.discard(staged)
    store.discard(staged)  # already gone: not an error
    assert temps(store.root) == []
    with pytest.raises(PreconditionError, match="gone"):
        store.commit(staged)
    assert not store.exists("x")


def test_clean_tmp_removes_leftovers(store: LocalStore, tmp_path: Path) -> None:
    assert store.clean_tmp() == 0
    store.stage(write_random(tmp_path / "x", 10), "x")  # a crash would leave this behind
    (store.root / TMP_DIRNAME / "orphan").write_bytes(b"half a checkpoint")
    assert store.clean_tmp() == 2
    assert temps(store.root) == []


def test_symlinked_tmp_dir_is_refused(store: LocalStore, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_bytes(b"keep me")
    (store.root / TMP_DIRNAME).symlink_to(elsewhere)
    with pytest.raises(UnsafePathError, match="symlink"):
        store.clean_tmp()
    with pytest.raises(UnsafePathError, match="symlink"):
        store.stage(write_random(tmp_path / "x", 10), "x")
    assert (elsewhere / "precious").read_bytes() == b"keep me"


def test_an_old_directory_at_the_final_name_moves_to_the_attic_whole(
    store: LocalStore, tmp_path: Path
) -> None:
    (store.root / "ckpt").mkdir()
    (store.root / "ckpt" / "old.bin").write_bytes(b"an older run of the format")
    src = write_random(tmp_path / "x", 10)
    push(store, src, "ckpt")
    assert (store.root / "ckpt").read_bytes() == src.read_bytes()
    (kept,) = (store.root / ".boxwarden-attic").glob("*/ckpt/old.bin")
    assert kept.read_bytes() == b"an older run of the format"  # moved aside, never deleted
    assert temps(store.root) == []


def test_an_old_file_where_a_directory_is_needed_moves_to_the_attic(
    store: LocalStore, tmp_path: Path
) -> None:
    src = write_random(tmp_path / "x", 10)
    push(store, src, "a")
    push(store, src, "a/b")
    assert (store.root / "a" / "b").read_bytes() == src.read_bytes()
    (kept,) = (store.root / ".boxwarden-attic").glob("*/a")
    assert kept.read_bytes() == src.read_bytes()
    assert temps(store.root) == []


def test_keep_aside_moves_an_old_copy_under_its_tag_and_never_replaces_one(
    store: LocalStore, tmp_path: Path
) -> None:
    src = write_random(tmp_path / "x", 10)
    push(store, src, "ckpt/best.pt")
    assert store.keep_aside("ckpt/best.pt", "retired-7") == ".boxwarden-attic/retired-7/ckpt/best.pt"
    assert not (store.root / "ckpt" / "best.pt").exists()
    kept = store.root / ".boxwarden-attic" / "retired-7" / "ckpt" / "best.pt"
    assert kept.read_bytes() == src.read_bytes()
    # A second call (a crash between the move and the ledger's record of it) finds it there.
    assert store.keep_aside("ckpt/best.pt", "retired-7") == ".boxwarden-attic/retired-7/ckpt/best.pt"
    assert store.keep_aside("ckpt/other.pt", "retired-8") is None  # nothing there, nothing kept
    # A copy at the path while the tag's place is taken: refused, both stay as they are.
    push(store, write_random(tmp_path / "y", 12), "ckpt/best.pt")
    with pytest.raises(StorageError, match="is taken already"):
        store.keep_aside("ckpt/best.pt", "retired-7")
    assert kept.read_bytes() == src.read_bytes()
    assert (store.root / "ckpt" / "best.pt").stat().st_size == 12


def test_keep_aside_never_follows_a_symlink(store: LocalStore, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"not ours")
    (store.root / "best.pt").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafePathError, match="symlink"):
        store.keep_aside("best.pt", "retired-1")
    assert (tmp_path / "elsewhere").read_bytes() == b"not ours"
    assert not (store.root / ".boxwarden-attic").exists()


def test_a_store_on_a_filesystem_that_folds_case_is_refused(case_insensitive_dir: Path) -> None:
    """Review 18, F01: on a case-insensitive durable filesystem `Step-100.bin` was committed over the
    kept copy of a deleted `step-100.bin` (one name there), and two current claims shared one copy."""
    root = case_insensitive_dir / "durable"
    root.mkdir()
    (root / "Step-100.bin").write_bytes(b"x")
    assert (root / "step-100.bin").read_bytes() == b"x"  # the filesystem really takes them for one
    (root / "Step-100.bin").unlink()
    with (
        LocalStoreClosing(LocalStore(root)) as store,
        pytest.raises(ConfigError, match="takes names that differ only in case for one file"),
    ):
        store.bind_owner("ledger-1")
    assert temps(root) == []  # the probe leaves nothing behind
    assert sorted(os.listdir(root)) == [TMP_DIRNAME]


def test_a_store_that_keeps_names_apart_is_bound_and_keeps_no_probe(store: LocalStore) -> None:
    store.bind_owner("ledger-1")
    assert temps(store.root) == []
    (store.root / "a.bin").write_bytes(b"x")
    assert not (store.root / "A.bin").exists()


def test_store_id_is_made_once_and_kept(store: LocalStore, tmp_path: Path) -> None:
    first = store.store_id()
    assert first == store.store_id()
    with LocalStoreClosing(LocalStore(store.root)) as same_root:
        assert same_root.store_id() == first
    other = tmp_path / "other-root"
    other.mkdir()
    with LocalStoreClosing(LocalStore(other.resolve())) as other_store:
        assert other_store.store_id() != first
    assert temps(store.root) == []


def test_foreign_staged_copy_is_refused(store: LocalStore, tmp_path: Path) -> None:
    other = tmp_path / "other-root"
    other.mkdir()
    with LocalStoreClosing(LocalStore(other.resolve())) as second:
        staged = second.stage(write_random(tmp_path / "x", 10), "x")
    with pytest.raises(PreconditionError, match="not staged by"):
        store.commit(staged)
    with pytest.raises(PreconditionError, match="not staged by"):
        store.discard(staged)
    assert isinstance(staged.handle, Path) and staged.handle.exists()  # a file store: its temp copy


class LocalStoreClosing:
    def __init__(self, store: LocalStore) -> None:
        self.store = store

    def __enter__(self) -> LocalStore:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


# ------------------------------------------------------------------------------ storage failures


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: a durable store that runs out of space for real.

    Needs root (or CAP_SYS_ADMIN). Skipped only when mount is refused for lack of permission;
    any other mount failure fails the test.
    """
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        err = proc.stderr.lower()
        if os.geteuid() != 0 or any(s in err for s in ("permission denied", "not permitted", "superuser")):
            pytest.skip(f"SKIPPED (EPERM): cannot mount a tmpfs here: {proc.stderr.strip()}")
        pytest.fail(f"mount tmpfs failed: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_no_space_is_a_storage_error_and_leaves_no_temp(
    tiny_fs: Path, tmp_path: Path, direct_io: bool
) -> None:
    root = tiny_fs / "durable"
    root.mkdir()
    store = LocalStore(root, direct_io=direct_io)
    src = write_random(tmp_path / "big", 2 << 20)
    try:
        with pytest.raises(StorageError, match="no space left") as info:
            store.stage(src, "big")
        assert str(tiny_fs / "durable") in str(info.value)
        assert temps(store.root) == []
        # the store still works for what fits
        small = push(store, write_random(tmp_path / "small", 1000), "small")
        assert store.verify("small", small.digest)
    finally:
        store.close()


def test_missing_root_is_a_storage_error(tmp_path: Path) -> None:
    root = tmp_path / "durable"
    store = LocalStore.from_url(root.as_uri())
    try:
        shutil.rmtree(root)  # the volume went away
        with pytest.raises(StorageError, match="mounted"):
            store.stage(write_random(tmp_path / "x", 10), "x")
    finally:
        store.close()


# ---------------------------------------------------------------------------------- open_store


@pytest.mark.parametrize("url", ["gs://bucket/prefix", "gs://b", "/just/a/path", "relative", "ftp://h/x"])
def test_unknown_scheme_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="supported: file://"):
        open_store(url)


def test_open_store_creates_root_but_not_parents(tmp_path: Path) -> None:
    store = open_store((tmp_path / "durable").as_uri())
    try:
        assert (tmp_path / "durable").is_dir()
        assert store.url == (tmp_path / "durable").as_uri()
        space = store.space()
        assert space is not None and space.path == (tmp_path / "durable").resolve()
        assert space.role == "durable" and space.total_bytes > 0 and 0 < space.free_bytes <= space.total_bytes
    finally:
        store.close()
    with pytest.raises(ConfigError, match="does not exist"):
        open_store((tmp_path / "no" / "such" / "durable").as_uri())


@pytest.mark.parametrize("url", ["file://host/abs", "file:relative", "file:///x?y=1"])
def test_malformed_file_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        open_store(url)


def test_root_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "durable").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        open_store((tmp_path / "durable").as_uri())


def test_constructor_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        LocalStore(tmp_path, chunk_size=1000)
    with pytest.raises(ValueError, match="absolute"):
        LocalStore(Path("relative"))


@pytest.mark.parametrize(
    "size",
    [0, 1, 4095, 4096, 4097, 3 * SMALL_DIRECT - 1, 3 * SMALL_DIRECT, 9 * SMALL_DIRECT + 17],
)
def test_hash_direct_reads_every_byte_of_any_size(
    tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_DIRECT reads come in whole blocks and several at once: a short tail, an exact multiple of
    the read size and more chunks than reads in flight must all hash as the file does."""
    monkeypatch.setattr(fsio, "DIRECT_CHUNK", SMALL_DIRECT)
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(fsio.DIRECT_DEPTH) as pool:
            assert direct_or_skip(fd, pool) == hashing.hash_file(path)
    finally:
        os.close(fd)


def direct_or_skip(fd: int, pool: ThreadPoolExecutor) -> str:
    try:
        return fsio.hash_direct(fd, pool)
    except fsio.DirectUnsupported as exc:
        pytest.skip(f"this filesystem takes no O_DIRECT reads ({exc})")


def test_hash_direct_reads_a_file_that_grew_since_it_was_sized_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reads are planned from fstat's size; bytes found past it are read and hashed too (one
    read at a time until a short one), never left out of the digest."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(300 << 10))
    real_fstat = os.fstat
    monkeypatch.setattr(fsio.os, "fstat", lambda fd: os.stat_result((0,) * 6 + (10,) + (0,) * 3))
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(fsio.DIRECT_DEPTH) as pool:
            found = direct_or_skip(fd, pool)
    finally:
        os.close(fd)
        monkeypatch.setattr(fsio.os, "fstat", real_fstat)
    assert found == hashing.hash_file(path)


def test_verify_from_the_device_catches_a_flipped_byte_in_a_big_copy(
    store: LocalStore, tmp_path: Path
) -> None:
    """A copy of many read chunks (O_DIRECT or, for the buffered store, the page cache): a byte
    flipped in the middle after commit fails the proof."""
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(20 << 20))
    staged = store.stage(src, "big.bin")
    store.commit(staged)
    assert store.verify("big.bin", staged.digest) == "reread"
    copy = store.root / "big.bin"
    with open(copy, "r+b") as f:
        f.seek(13 << 20)
        byte = f.read(1)
        f.seek(13 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert store.verify("big.bin", staged.digest) is None


def test_verify_falls_back_to_the_page_cache_where_o_direct_reads_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that takes O_DIRECT at open but refuses the read (EINVAL, as some FUSE and
    network mounts do): verify still proves the copy, by reading through the page cache, and
    keeps doing so; the fd it fell back on has O_DIRECT cleared (its reads would fail too)."""
    root = tmp_path / "store"
    root.mkdir()
    store = LocalStore(root, direct_io=True)  # verify re-reads with O_DIRECT from the start
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(3 << 20))
    real_preadv = os.preadv
    refused: list[int] = []

    def preadv(fd: int, buffers: list[mmap.mmap], offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    flags_seen: list[int] = []

    def hash_by_read(fd: int, pace: object) -> str:
        flags_seen.append(fcntl.fcntl(fd, fcntl.F_GETFL))
        return fsio.hash_by_read(fd)

    try:
        staged = store.stage(src, "f.bin")
        store.commit(staged)
        monkeypatch.setattr(fsio.os, "preadv", preadv)
        monkeypatch.setattr(local, "hash_by_read", hash_by_read)
        assert store.verify("f.bin", staged.digest) == "reread"
        assert refused  # it tried O_DIRECT first
        n = len(refused)
        assert store.verify("f.bin", staged.digest) == "reread"
        assert len(refused) == n  # and does not try again
        with open(root / "f.bin", "r+b") as f:
            f.write(b"X")
        assert store.verify("f.bin", staged.digest) is None  # the fallback still proves
        assert flags_seen and not any(f & os.O_DIRECT for f in flags_seen)
    finally:
        store.close()
