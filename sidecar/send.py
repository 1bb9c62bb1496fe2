"""The box-side half of a bulk pull: one claimed file's bytes on stdout, outside gRPC.

Run as `python -m sidecar.send ARTIFACT OFFSET LENGTH WATCH_DIR...` (the watched dirs as the
sidecar's Hello names them). Writes exactly LENGTH bytes of the artifact's file from OFFSET to
stdout, by sendfile(2) where the kernel can, and exits 0; anything else (no such artifact, a
symlink on the way, not a regular file, fewer bytes than asked) is one line on stderr and exit 3.
It never exits 255, which ssh keeps for its own failures.

This process proves nothing: it takes no lock and reads no claim. The controller hashes what
arrives and keeps it only if it equals the claim; when it does not, the controller reads the file
through the sidecar's ReadArtifact, which checks the bytes on the box (and seals the file again if
they changed). It exists because a pull of a large checkpoint through gRPC costs several times the
CPU of one through the SSH session's own channel. Runs on Python 3.9+ and imports only the
standard library and `sidecar.paths`.
"""

from __future__ import annotations

import errno
import os
import select
import sys
from pathlib import Path

from sidecar.errors import SidecarError
from sidecar.paths import ArtifactNamer, open_regular

REFUSED = 3
CHUNK = 8 << 20


def send(fd: int, out: int, offset: int, length: int) -> int:
    """Write `length` bytes of `fd` from `offset` to `out`; returns how many were there to send."""
    sent = 0
    use_sendfile = True
    while sent < length:
        want = min(CHUNK, length - sent)
        try:
            if use_sendfile:
                n = os.sendfile(out, fd, offset + sent, want)
            else:
                data = os.pread(fd, want, offset + sent)
                n = _write_all(out, data)
        except BlockingIOError:  # a non-blocking stdout: wait until it takes more
            select.select([], [out], [])
            continue
        except OSError as e:
            if use_sendfile and e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                use_sendfile = False  # an stdout sendfile cannot write to: plain reads and writes
                continue
            raise
        if n == 0:
            break  # the file ended early
        sent += n
    return sent


def _write_all(out: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(out, view) :]
        except BlockingIOError:
            select.select([], [out], [])
    return len(data)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 4 or not args[1].isdigit() or not args[2].isdigit():
        print("usage: python -m sidecar.send ARTIFACT OFFSET LENGTH WATCH_DIR...", file=sys.stderr)
        return REFUSED
    art, offset, length = args[0], int(args[1]), int(args[2])
    namer = ArtifactNamer(tuple(Path(d) for d in args[3:]))
    try:
        fd = open_regular(namer.to_abs(art), follow=False)
    except (SidecarError, OSError) as e:
        print(f"{art}: {e}", file=sys.stderr)
        return REFUSED
    try:
        sent = send(fd, sys.stdout.fileno(), offset, length)
    except BrokenPipeError:
        return REFUSED  # the receiver went away: nobody reads this answer
    except OSError as e:
        print(f"{art}: reading or sending failed: {e}", file=sys.stderr)
        return REFUSED
    finally:
        os.close(fd)
    if sent != length:
        print(f"{art}: the file holds {offset + sent} bytes, not {offset + length}", file=sys.stderr)
        return REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
