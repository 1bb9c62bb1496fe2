"""sidecar.priority: worker threads really run at nice 10 and best-effort I/O level 7, as the kernel
reports them, and nothing else in the process changes."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from sidecar import priority
from sidecar.priority import LOWERED_IOPRIO, NICE, lower_this_thread, thread_priority
from sidecar.storage.local import LocalStore

T = TypeVar("T")

IOPRIO_KNOWN = platform.machine() in ("x86_64", "aarch64", "riscv64")


def in_thread(fn: Callable[[], T]) -> T:
    """fn's result, computed in a fresh plain thread (which ends with it)."""
    out: list[T] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_an_executor_with_the_initializer_runs_its_workers_lowered() -> None:
    main_before = thread_priority()
    assert main_before[0] < NICE, "run the tests at a nice below 10"
    with ThreadPoolExecutor(max_workers=2, initializer=lower_this_thread) as pool:
        tid, seen = pool.submit(lambda: (threading.get_native_id(), thread_priority())).result()
        from_outside = thread_priority(tid)  # read from another thread, while the worker lives
    assert seen[0] == NICE
    assert from_outside == seen
    if IOPRIO_KNOWN:
        assert seen[1] == LOWERED_IOPRIO  # class best-effort (2) << 13 | level 7
    assert thread_priority() == main_before  # nice and ioprio are per thread: the caller is untouched
    # A thread started now by the (unlowered) main thread starts unlowered.
    assert in_thread(thread_priority) == main_before


def test_a_thread_started_by_a_lowered_one_inherits_its_priority() -> None:
    def start_one() -> tuple[int, int | None]:
        lower_this_thread()
        return in_thread(thread_priority)

    nice, io = in_thread(start_one)
    assert nice == NICE
    if IOPRIO_KNOWN:
        assert io == LOWERED_IOPRIO


def test_a_thread_already_lower_is_never_raised() -> None:
    def at_15_and_idle() -> tuple[int, int | None]:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 15)
        subprocess.run(["ionice", "-c", "3", "-p", str(tid)], check=True)
        lower_this_thread()
        return thread_priority()

    nice, io = in_thread(at_15_and_idle)
    assert nice == 15
    if IOPRIO_KNOWN:
        assert io is not None and io >> 13 == 3  # still the idle class


def test_a_refusal_never_raises_and_is_noted_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(which: int, who: int, prio: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    monkeypatch.setattr(priority, "_SYSCALLS", {})
    monkeypatch.setattr(priority, "_refusal_noted", threading.Event())
    caplog.set_level(logging.DEBUG, logger="sidecar.priority")
    with ThreadPoolExecutor(max_workers=1, initializer=lower_this_thread) as pool:
        nice, io = pool.submit(thread_priority).result()  # the pool is not broken
    in_thread(lower_this_thread)
    assert nice == thread_priority()[0] and io is None
    notes = [r.getMessage() for r in caplog.records if r.name == "sidecar.priority"]
    assert len(notes) == 1, notes
    assert "Operation not permitted" in notes[0] and "no ioprio syscall" in notes[0]


def test_the_file_store_writes_from_lowered_threads(tmp_path: Path) -> None:
    root = tmp_path / "durable"
    root.mkdir()
    src = tmp_path / "src"
    src.write_bytes(os.urandom(2 << 20))
    before = set(threading.enumerate())  # (another test's store may have left writers of its own)
    store = LocalStore(root, chunk_size=256 << 10)
    try:
        store.stage(src, "x")
        writers = [
            t for t in threading.enumerate() if t.name.startswith("boxwarden-write") and t not in before
        ]
        assert writers
        for t in writers:
            assert t.native_id is not None
            nice, io = thread_priority(t.native_id)
            assert nice == NICE
            if IOPRIO_KNOWN:
                assert io == LOWERED_IOPRIO
    finally:
        store.close()
    assert thread_priority()[0] < NICE


def test_the_s3_store_uploads_from_lowered_threads() -> None:
    pytest.importorskip("botocore")
    from sidecar.storage.s3 import S3Store

    store = S3Store(object(), "bucket", "", url="s3://bucket")
    try:
        nice, io = store._pool.submit(thread_priority).result()
    finally:
        store.close()
    assert nice == NICE
    if IOPRIO_KNOWN:
        assert io == LOWERED_IOPRIO
