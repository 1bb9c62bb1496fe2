"""Figure: seal → durable+proven, `s3://` (moto's S3 server on loopback) — `stage + commit + verify`
vs what a user would script with boto3.

Baseline: `client.upload_file(src, bucket, key)` (boto3's managed multipart upload: 8 MiB parts, 10
threads), then a full download of the object to a local file (one streamed GET), then
`b3sum src dst` — upload, read it all back, and prove both ends equal. The download is one GET, not
`download_file`: moto answers each ranged GET of `download_file` by reading the whole object, so
that took 5-6 s for 256 MiB here against 1 s for one GET, a baseline slowed for moto's sake only.

Ours: `S3Store.stage` (one read pass: blake3 + the parts of a multipart upload, each with its
SHA256), `commit` (complete the upload, write the digest into the metadata), `verify` (GET the
whole object, blake3 equal to the claim).

The server is one moto process started here on a free port and stopped by its PID at the end; both
sides talk to it with the same client settings, at the priority of the sidecar's workers (as in
`bench.push`), and each side's object is deleted before every run.
Before every run the source is hot in the page cache, as a file a trainer just wrote. At most RUNS
runs per side (1 GiB takes ~20 s a side against moto), with no warm-up run: the first run, slower
for both, falls on ours.
"""

from __future__ import annotations

import logging
import shutil
from typing import Any

from bench.common import (
    Context,
    FigureResult,
    Side,
    Timing,
    clock,
    interleaved,
    lowered,
    lowered_argv,
    make_hot,
    quiesce,
    remove,
    run_quiet,
    timed_push,
)
from sidecar.storage import open_store

logger = logging.getLogger(__name__)

KEY = "seal-durable-s3"
TITLE = "seal → durable+proven, s3:// (moto)"
TARGET = 0.8  # ≤ 0.8× the baseline's time
REL = "ckpt.bin"
SCOPE = ("bench", "run-0001")
RUNS = 5
_DOWNLOAD_CHUNK = 8 << 20


def run(ctx: Context) -> FigureResult:
    from tests.s3server import running_s3, write_credentials  # the tests' moto server, stopped by PID

    src = ctx.source_file()
    dst = ctx.work_dir / "s3-download.bin"
    with running_s3(ctx.work_dir / "moto.log") as s3:
        client: Any = s3.client()
        bucket = s3.bucket()
        store = open_store(s3.url(bucket), SCOPE, credentials=write_credentials(ctx.work_dir / "s3-creds"))
        ours_key = "durable/" + "/".join((*SCOPE, REL))
        base_key = "baseline/" + REL
        expected: set[str] = set()

        def prepare() -> None:
            for key in (ours_key, base_key):
                client.delete_object(Bucket=bucket, Key=key)
            remove(dst)
            quiesce()
            make_hot(src)

        def ours() -> Timing:
            prepare()
            return lowered(push)

        def push() -> Timing:
            timing, digest = timed_push(store, src, REL, KEY)
            expected.add(digest)
            return timing

        def transfer() -> None:
            client.upload_file(str(src), bucket, base_key)

        def download() -> None:
            body = client.get_object(Bucket=bucket, Key=base_key)["Body"]
            with body, open(dst, "wb") as f:
                shutil.copyfileobj(body, f, _DOWNLOAD_CHUNK)

        def baseline() -> Timing:
            prepare()
            t0 = clock()
            lowered(transfer)
            t1 = clock()
            lowered(download)
            t2 = clock()
            out = run_quiet(lowered_argv(["b3sum", "--no-names", str(src), str(dst)]))
            t3 = clock()
            digests = out.split()
            if len(digests) != 2 or digests[0] != digests[1]:
                raise RuntimeError(f"{KEY}: the downloaded copy differs from its source: {digests}")
            expected.add(digests[0])
            return Timing(t3 - t0, {"upload": t1 - t0, "download": t2 - t1, "b3sum": t3 - t2})

        o = Side("S3Store stage+commit+verify")
        b = Side("boto3 upload_file; GET to a file; b3sum src dst")
        try:
            interleaved(min(ctx.runs, RUNS), ours, baseline, o, b)
        finally:
            store.close()
            remove(dst)
    if len(expected) != 1:
        raise RuntimeError(f"{KEY}: the two sides saw different digests: {sorted(expected)}")
    notes = [
        "ours' commit is complete_multipart_upload + a PutObjectTagging that labels the object with its "
        "blake3 (a copy onto itself only for ?proof=server-checksum, or a store without tagging)",
        "the store at full speed, as a drain pushes; between drains the sidecar keeps to its push rate",
    ]
    return FigureResult(KEY, TITLE, o, b, "time", TARGET, ctx.size, notes=notes)
