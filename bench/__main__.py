"""`python -m bench`: run the registered figures, print the table, write bench/results.json.

To add a figure: write `bench/<name>.py` with `KEY` and `run(ctx) -> FigureResult`, and list it
in FIGURES below.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from bench import fleet, hashing, health, push, remote, s3push, scale, trainstep
from bench.common import REPO, Context, FigureResult, MiB, fs_type, is_memory_fs, machine_info

logger = logging.getLogger(__name__)

FIGURES: dict[str, ModuleType] = {
    m.KEY: m for m in (hashing, push, s3push, trainstep, health, scale, remote, fleet)
}

DEFAULT_OUTPUT = REPO / "bench" / "results.json"
# Copies written there are sized like checkpoints; /tmp is often tmpfs (RAM), where "durable" and
# "re-read from the device" mean nothing. /var/tmp is disk on every distribution we target.
DEFAULT_PARENTS = (Path("/var/tmp"), REPO / "bench" / ".work")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("figures", nargs="*", metavar="FIGURE", help="run only these (as --only)")
    p.add_argument("--runs", type=int, default=5, help="runs per side; medians are reported (default 5)")
    p.add_argument("--size-mib", type=int, default=1024, help="size of the test file (default 1024)")
    p.add_argument(
        "--dir", type=Path, help="parent for the work directory (default /var/tmp); must be a disk"
    )
    p.add_argument(
        "--only", action="append", choices=sorted(FIGURES), help="run only this figure (repeatable)"
    )
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where to write the JSON results")
    p.add_argument("--strict", action="store_true", help="exit 1 if any target is missed")
    args = p.parse_args(argv)
    if args.runs < 1 or args.size_mib < 1:
        p.error("--runs and --size-mib must be positive")
    unknown = sorted(set(args.figures) - set(FIGURES))
    if unknown:
        p.error(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(sorted(FIGURES))}")
    args.only = (args.only or []) + args.figures or None
    return args


def _work_parent(requested: Path | None) -> Path:
    if requested is not None:
        if is_memory_fs(requested):
            raise SystemExit(f"--dir {requested} is on {fs_type(requested)} (memory); pick a disk-backed dir")
        return requested
    for parent in DEFAULT_PARENTS:
        parent.mkdir(parents=True, exist_ok=True)
        if not is_memory_fs(parent):
            return parent
    raise SystemExit("no disk-backed default work dir found; pass --dir")


def _table(results: list[FigureResult]) -> str:
    head = ("figure", "ours", "baseline", "ratio", "target", "result")
    rows = [head]
    for r in results:
        rows.append(
            (
                f"{r.title}, {r.size_bytes // MiB} MiB",
                _secs(r.ours.median_s),
                _secs(r.baseline.median_s),
                f"{r.ratio:.3f} ({r.ratio_kind})",
                r.target_text,
                "pass" if r.passed else "FAIL",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("medians; every run, sorted:")
    for r in results:
        for name, side in (("ours", r.ours), ("baseline", r.baseline)):
            runs = ", ".join(_secs(t) for t in sorted(t.total for t in side.runs))
            lines.append(f"  {r.key} {name} = {side.label}: {runs}")
            parts = side.to_json()["parts_median_s"]
            if parts:
                lines.append("    median parts: " + ", ".join(f"{k} {v:.3f} s" for k, v in parts.items()))
        lines.extend(f"  {r.key} note: {note}" for note in r.notes)
    return "\n".join(lines)


def _secs(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 0.1 else f"{t:.3f} s"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    keys = args.only or list(FIGURES)
    size = args.size_mib * MiB
    parent = _work_parent(args.dir)
    free = shutil.disk_usage(parent).free
    if free < 3 * size + 256 * MiB:
        raise SystemExit(f"{parent} has {free // MiB} MiB free; the bench needs {3 * size // MiB + 256} MiB")
    work = Path(tempfile.mkdtemp(prefix="boxwarden-bench-", dir=parent))
    info = machine_info(work)
    results: list[FigureResult] = []
    try:
        ctx = Context(work_dir=work, size=size, runs=args.runs)
        for key in keys:
            print(f"{key}: {args.runs} runs per side, {args.size_mib} MiB, in {work}", file=sys.stderr)
            run: Callable[[Context], FigureResult | list[FigureResult]] = FIGURES[key].run
            out = run(ctx)  # a figure may report several results (scale: one per budget)
            results.extend(out if isinstance(out, list) else [out])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["loadavg_at_end"] = os.getloadavg()
    doc = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "runs": args.runs,
        "size_bytes": size,
        "machine": info,
        "figures": [r.to_json() for r in results],
        "all_pass": all(r.passed for r in results),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, args.output)
    print(_table(results))
    print(f"results: {args.output}")
    return 1 if args.strict and not doc["all_pass"] else 0


if __name__ == "__main__":
    sys.exit(main())
