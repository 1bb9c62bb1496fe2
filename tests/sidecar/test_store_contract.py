"""The durable-store contract without filesystem assumptions: the single read pass any backend's
sink shares (`storage/copier.py`), the staged copy as an opaque handle, the store's free space as
something it may not know, and the credentials file a backend may be given."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar import config
from sidecar.errors import ConfigError, PreconditionError, StorageError
from sidecar.ledger import Ledger
from sidecar.probes import DiskSample
from sidecar.storage import StagedCopy, local_dir
from sidecar.storage.copier import single_pass
from sidecar.storage.local import LocalStore
from tests.sidecar.conftest import make_sealer

CHUNK = 64 << 10


class MemorySink:
    """A sink that keeps what it is given in memory, and records how the writes overlapped."""

    def __init__(self, *, slow_s: float = 0.0, fail_at: int | None = None, alone_at: int = -1) -> None:
        self.data = bytearray()
        self.ends: list[int] = []
        self.events: list[tuple[str, int, int]] = []  # ("start" | "end", offset, writes in flight)
        self.most_in_flight = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._slow_s, self._fail_at, self._alone_at = slow_s, fail_at, alone_at
        self._chunks = 0

    def write(self, data: memoryview, offset: int) -> None:
        with self._lock:
            self._in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self._in_flight)
            self.events.append(("start", offset, self._in_flight))
        try:
            time.sleep(self._slow_s)  # a slow device, so that writes overlap
            if offset == self._fail_at:
                raise StorageError(f"device error at {offset}")
            with self._lock:
                if len(self.data) < offset + len(data):
                    self.data.extend(b"\0" * (offset + len(data) - len(self.data)))
                self.data[offset : offset + len(data)] = data
        finally:
            with self._lock:
                self._in_flight -= 1
                self.events.append(("end", offset, self._in_flight))

    def written(self, end: int) -> None:
        self.ends.append(end)

    def already(self, data: memoryview, offset: int) -> bool:
        return False

    def alone(self, n: int) -> bool:
        """True for the chunk number `alone_at` (from 0)."""
        self._chunks += 1
        return self._chunks - 1 == self._alone_at

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as p:
        yield p


def copy(src: Path, sink: MemorySink, pool: ThreadPoolExecutor, **kw: object) -> tuple[str, int]:
    fd = os.open(src, os.O_RDONLY)
    try:
        return single_pass(src, fd, sink, pool, chunk_size=CHUNK, limit=os.fstat(fd).st_size, **kw)  # type: ignore[arg-type]
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, 3 * CHUNK + 5])
def test_the_sink_gets_exactly_the_bytes_that_were_hashed(
    tmp_path: Path, pool: ThreadPoolExecutor, size: int
) -> None:
    src = tmp_path / "ckpt.bin"
    src.write_bytes(os.urandom(size))
    sink = MemorySink()
    seen: list[int] = []
    digest, copied = copy(src, sink, pool, progress=seen.append)
    assert (digest, copied) == (blake3.blake3(src.read_bytes()).hexdigest(), size)
    assert bytes(sink.data) == src.read_bytes()
    assert sink.ends == sorted(sink.ends) and sink.ends[-1:] == ([size] if size else [])
    assert seen == sink.ends  # progress counts what was read, in the same steps


def test_a_file_that_grows_while_it_is_read_ends_the_pass_at_its_sealed_size(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    src = tmp_path / "train.log"
    src.write_bytes(os.urandom(3 * CHUNK))

    def append(copied: int) -> None:  # a writer that outruns the reader: the pass must still end
        with open(src, "ab") as f:
            f.write(os.urandom(CHUNK))

    sink = MemorySink()
    digest, copied = copy(src, sink, pool, progress=append)
    assert copied == 3 * CHUNK and bytes(sink.data) == src.read_bytes()[: 3 * CHUNK]
    assert digest == blake3.blake3(src.read_bytes()[: 3 * CHUNK]).hexdigest()


def test_no_more_writes_are_in_flight_than_buffers(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    src = tmp_path / "ckpt.bin"
    src.write_bytes(os.urandom(12 * CHUNK))
    sink = MemorySink(slow_s=0.01)
    copy(src, sink, pool, buffers=3)
    assert sink.most_in_flight == 3  # reached (the pass overlaps) and never passed (bounded memory)
    assert bytes(sink.data) == src.read_bytes()


def test_a_chunk_written_alone_has_no_other_write_beside_it(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    src = tmp_path / "ckpt.bin"
    src.write_bytes(os.urandom(6 * CHUNK))
    sink = MemorySink(slow_s=0.01, alone_at=3)
    copy(src, sink, pool)
    assert sink.most_in_flight > 1  # the others do overlap
    i = sink.events.index(("start", 3 * CHUNK, 1))  # nothing else in flight when it started...
    assert sink.events[i + 1] == ("end", 3 * CHUNK, 0)  # ...nor before it ended
    assert bytes(sink.data) == src.read_bytes()


def test_a_failed_write_is_raised_once_no_write_is_in_flight(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    src = tmp_path / "ckpt.bin"
    src.write_bytes(os.urandom(10 * CHUNK))
    sink = MemorySink(slow_s=0.01, fail_at=2 * CHUNK)
    with pytest.raises(StorageError, match=f"device error at {2 * CHUNK}"):
        copy(src, sink, pool)
    assert sink.in_flight == 0  # the caller may close what the sink writes to
    assert max(sink.ends, default=0) <= 2 * CHUNK  # nothing after the failure is called written


def test_a_failed_read_of_the_source_is_a_storage_error(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    src = tmp_path / "ckpt.bin"
    src.write_bytes(b"x" * 100)
    fd = os.open(src, os.O_WRONLY)  # readv on a write-only fd fails with EBADF
    try:
        with pytest.raises(StorageError, match="reading source"):
            single_pass(src, fd, MemorySink(), pool, chunk_size=CHUNK, limit=100)
    finally:
        os.close(fd)


# --- the staged copy is the store's own business -------------------------------------------------


def test_a_copy_staged_by_another_store_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = LocalStore(tmp_path / "a"), LocalStore(tmp_path / "b")
    try:
        src = tmp_path / "ckpt.bin"
        src.write_bytes(os.urandom(5000))
        staged = a.stage(src, "ckpt.bin")
        for use in (b.commit, b.discard):
            with pytest.raises(PreconditionError, match="was not staged by the store at"):
                use(staged)
        assert isinstance(staged.handle, Path) and staged.handle.exists()
        forged = StagedCopy(
            rel="ckpt.bin", handle=str(staged.handle), digest=staged.digest, size=5000, source=staged.source
        )
        with pytest.raises(PreconditionError):
            a.commit(forged)  # a path given as text is not a handle this store made
        a.commit(staged)
        assert a.verify("ckpt.bin", staged.digest) and not b.exists("ckpt.bin")
    finally:
        a.close()
        b.close()


# --- free space: what the store can say, and what it cannot ----------------------------------------


class SpacelessStore(LocalStore):
    """A file store that answers `space()` the way an object store does (None), or fails to."""

    answer: DiskSample | StorageError | None = None

    def space(self) -> DiskSample | None:
        if isinstance(self.answer, StorageError):
            raise self.answer
        return self.answer


def space_short(tmp_path: Path, answer: DiskSample | StorageError | None, size: int) -> str:
    (tmp_path / "durable").mkdir(exist_ok=True)
    (tmp_path / "watch").mkdir(exist_ok=True)
    store = SpacelessStore(tmp_path / "durable")
    store.answer = answer
    ledger = Ledger(tmp_path / "ledger.sqlite")

    async def ask() -> str:
        with ThreadPoolExecutor(1) as ex:
            sealer = make_sealer(tmp_path / "watch", ledger, store, ex)
            return sealer._space_short(size)

    try:
        return asyncio.run(ask())
    finally:
        ledger.close()
        store.close()


def test_a_store_without_a_notion_of_space_is_never_refused_for_it(tmp_path: Path) -> None:
    assert space_short(tmp_path, None, 1 << 40) == ""


def test_a_store_whose_space_cannot_be_read_is_refused_with_the_reason(tmp_path: Path) -> None:
    why = space_short(tmp_path, StorageError("statvfs: stale file handle"), 10)
    assert "cannot read the durable store's free space" in why and "stale file handle" in why


def test_a_copy_that_would_not_fit_is_refused_before_it_starts(tmp_path: Path) -> None:
    full = DiskSample(
        tmp_path, "durable", total_bytes=10 << 30, free_bytes=1 << 30, total_inodes=9, free_inodes=9
    )
    why = space_short(tmp_path, full, 1 << 30)  # fits the free bytes, not with the reserve kept
    assert why.startswith("NO_SPACE: won't fit") and str(1 << 30) in why
    assert space_short(tmp_path, full, 100 << 20) == ""


def test_local_dir_names_a_directory_for_file_urls_only() -> None:
    assert local_dir("file:///mnt/durable%20x") == Path("/mnt/durable x")
    assert local_dir("file://localhost/mnt/d") == Path("/mnt/d")
    for url in ("file://host/mnt/d", "file:relative", "s3://bucket/prefix", "", "/mnt/d"):
        assert local_dir(url) is None, url


# --- the credentials file ------------------------------------------------------------------------


def message(tmp_path: Path, credentials: str) -> pb.SidecarConfig:
    watch = tmp_path / "watch"
    watch.mkdir(exist_ok=True)
    return pb.SidecarConfig(
        box_name="b1",
        state_dir=str(tmp_path / "state"),
        socket_path=str(tmp_path / "s.sock"),
        watch_dirs=[str(watch)],
        durable_url=(tmp_path / "durable").as_uri(),
        durable_credentials_file=credentials,
    )


SECRET = "aws_secret_access_key = never-shown-4f2a"


def test_a_private_credentials_file_is_taken(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.write_text(SECRET)
    creds.chmod(0o600)
    assert config.from_message(message(tmp_path, str(creds))).durable_credentials == creds
    assert config.from_message(message(tmp_path, "")).durable_credentials is None


def test_a_credentials_file_others_could_read_or_swap_is_refused(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.write_text(SECRET)
    link = tmp_path / "link"
    link.symlink_to(creds)
    cases = {
        "relative": ("creds", "is not absolute"),
        "missing": (str(tmp_path / "none"), "cannot look at"),
        "symlink": (str(link), "not a regular file"),
        "directory": (str(tmp_path), "not a regular file"),
        "readable": (str(creds), "chmod 600"),
    }
    creds.chmod(0o644)
    for case, (path, why) in cases.items():
        with pytest.raises(ConfigError, match="durable_credentials_file") as e:
            config.from_message(message(tmp_path, path))
        assert why in str(e.value), case
        assert "never-shown" not in str(e.value)
    creds.chmod(0o600)
    os.chown(creds, 65534, 65534)  # nobody's: tests run as root
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        config.from_message(message(tmp_path, str(creds)))
