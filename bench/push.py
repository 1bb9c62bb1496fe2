"""Figure: seal → durable+verified, 1 GiB, file:// — `stage + commit + verify` vs the shell way.

Baseline: `cp src dst && sync dst`, drop dst from the page cache (posix_fadvise DONTNEED, as our
verify does), then `b3sum src dst` — copy, make durable, and prove the copy equals the source.
Ours: `LocalStore.stage` (one pass: hash + copy, written back behind the writer), `commit` (fsync,
rename, fsync dirs), `verify` (drop, re-read from the device through the page cache, shown to have
come from storage, and compare with the claim digest).

Both sides run at the priority of the sidecar's workers (nice 10, best-effort I/O level 7): ours in
a thread lowered as the sidecar's are, the baseline's commands under `nice`/`ionice`; on a shared,
busy machine the comparison is then of the two ways to copy and prove, not of two priorities.

Before every run of either side: the source is hot in the page cache (as a file a trainer has just
written), the destination does not exist, and pending writeback has been flushed.
"""

from __future__ import annotations

import logging

from bench.common import (
    Context,
    FigureResult,
    Side,
    Timing,
    clock,
    drop_from_cache,
    interleaved,
    lowered,
    lowered_argv,
    make_hot,
    quiesce,
    remove,
    run_quiet,
    timed_push,
)
from sidecar.storage.local import LocalStore
from sidecar.storage.pace import DEFAULT_RATE

logger = logging.getLogger(__name__)

KEY = "seal-durable"
TITLE = "seal → durable+verified, file://"
TARGET = 0.95  # ≤ 0.95× the baseline's time
REL = "run-0001/ckpt.bin"


def run(ctx: Context) -> FigureResult:
    src = ctx.source_file()
    dst = ctx.work_dir / "baseline-dst.bin"
    durable_root = ctx.work_dir / "durable"
    durable_root.mkdir(exist_ok=True)
    store = LocalStore.from_url(durable_root.as_uri())
    copy = durable_root / REL
    expected: set[str] = set()

    def prepare() -> None:
        remove(dst)
        remove(copy)
        quiesce()
        make_hot(src)

    def ours() -> Timing:
        prepare()
        return lowered(push)

    def push() -> Timing:
        timing, digest = timed_push(store, src, REL, KEY)
        expected.add(digest)
        return timing

    def baseline() -> Timing:
        prepare()
        t0 = clock()
        run_quiet(lowered_argv(["sh", "-c", 'cp -- "$1" "$2" && sync -- "$2"', "sh", str(src), str(dst)]))
        t1 = clock()
        drop_from_cache(dst)
        out = run_quiet(lowered_argv(["b3sum", "--no-names", str(src), str(dst)]))
        t2 = clock()
        lines = out.split()
        if len(lines) != 2 or lines[0] != lines[1]:
            raise RuntimeError(f"{KEY}: baseline copy differs from its source: {lines}")
        expected.add(lines[0])
        return Timing(t2 - t0, {"cp+sync": t1 - t0, "drop+b3sum": t2 - t1})

    o = Side("LocalStore stage+commit+verify, in a lowered thread")
    b = Side("nice/ionice: cp && sync; fadvise DONTNEED dst; b3sum src dst")
    try:
        interleaved(ctx.runs, ours, baseline, o, b, warmup=True)
    finally:
        store.close()
        remove(dst)
        remove(copy)
    if len(expected) != 1:
        raise RuntimeError(f"{KEY}: the two sides saw different digests: {sorted(expected)}")
    notes = [
        "the store at full speed, as a drain pushes; between drains the sidecar keeps to its push rate "
        f"({DEFAULT_RATE / 1e6:g} MB/s by default: train-step)"
    ]
    return FigureResult(KEY, TITLE, o, b, "time", TARGET, ctx.size, notes=notes)
