"""The program of a queued cell in tests: it counts its runs in <marks>/<cell>.runs, waits for
<marks>/<cell>.gate if asked to (`--gate`; two minutes at most, so that a failed test leaves nothing
running for long), saves one checkpoint as <out>/<cell>/ckpt-1.pt unless it fails (with
`--safetensors`: a loadable <out>/<cell>/ckpt-1.safetensors, for a box that is verified and torn
down), writes <marks>/<cell>.end and exits with $CELL_EXIT. The cell is the sidecar's BOXWARDEN_CELL."""

from __future__ import annotations

import sys
from pathlib import Path

CELL = r"""
import json, os, struct, sys, time, pathlib
cell = os.environ["BOXWARDEN_CELL"]
marks, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with open(marks / (cell + ".runs"), "a") as f:
    f.write("%d %s\n" % (os.getpid(), " ".join(sys.argv[3:])))
if "--gate" in sys.argv:
    deadline = time.monotonic() + 120
    while not (marks / (cell + ".gate")).exists():
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.05)
code = int(os.environ.get("CELL_EXIT", "0"))
if code == 0:
    (out / cell).mkdir(parents=True, exist_ok=True)
    if "--safetensors" in sys.argv:
        head = json.dumps({"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}).encode()
        head += b" " * (-len(head) % 8)
        tmp = out / cell / "ckpt-1.safetensors.tmp"
        tmp.write_bytes(struct.pack("<Q", len(head)) + head + os.urandom(4096))
        os.replace(tmp, out / cell / "ckpt-1.safetensors")
    else:
        (out / cell / "ckpt-1.pt").write_bytes(b"\x80" + os.urandom(4096))
(marks / (cell + ".end")).write_text("end")
sys.exit(code)
"""


def cell_argv(marks: Path, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-c", CELL, str(marks), str(out), *flags]


def runs(marks: Path, cell: str) -> list[str]:
    """One line per run of the cell: its pid and its extra arguments."""
    path = marks / f"{cell}.runs"
    return path.read_text().splitlines() if path.exists() else []
