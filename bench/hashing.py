"""Figure: hash a hot 1 GiB file — `sidecar.hashing.hash_file` vs `b3sum <file>`.

The baseline's time includes starting the b3sum process; that is what a user would run, and a few
milliseconds against ~0.2 s. Both sides must print the same digest or the figure is void.
"""

from __future__ import annotations

import logging

from bench.common import Context, FigureResult, Side, Timing, clock, interleaved, make_hot, run_quiet
from sidecar.hashing import hash_file

logger = logging.getLogger(__name__)

KEY = "hash-hot"
TITLE = "hash a hot file"
TARGET = 0.9  # ≥ 0.9× b3sum's throughput


def run(ctx: Context) -> FigureResult:
    src = ctx.source_file()
    digests: set[str] = set()

    def ours() -> Timing:
        make_hot(src)
        t0 = clock()
        digests.add(hash_file(src))
        return Timing(clock() - t0)

    def baseline() -> Timing:
        make_hot(src)
        t0 = clock()
        out = run_quiet(["b3sum", "--no-names", str(src)])
        elapsed = clock() - t0
        digests.add(out.strip())
        return Timing(elapsed)

    o, b = Side("sidecar.hashing.hash_file"), Side("b3sum FILE")
    interleaved(ctx.runs, ours, baseline, o, b)
    if len(digests) != 1:
        raise RuntimeError(f"{KEY}: hash_file and b3sum disagree: {sorted(digests)}")
    return FigureResult(KEY, TITLE, o, b, "throughput", TARGET, ctx.size)
