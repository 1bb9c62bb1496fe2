"""The `s3://` durable store against a real S3 server (moto's, on loopback): one read pass into a
multipart upload, nothing visible before commit, the proof by a full re-read, uploads left by a
crash aborted, ownership written once, nothing ever deleted that was not first copied aside, and
credentials that never show.

(Not under tests/sidecar: the moto server is a child of the test process, and the sidecar's job
tests count every child of the process as the job's; those run first.)"""

from __future__ import annotations

import base64
import dataclasses
import os
import random
import re
import signal
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from sidecar.errors import ChangedError, ConfigError, PreconditionError, StorageError
from sidecar.storage import crc, open_store
from sidecar.storage.s3 import MAX_PARTS, S3Store, part_size, read_credentials
from tests.conftest import save_ckpt
from tests.s3server import KEY_ID, SECRET, S3Server, write_credentials
from tests.sidecar.daemon import make_daemon, running, short_dir
from tests.sidecar.test_crash import durable_claims
from tests.sidecar.test_storage import write_random

MIB = 1 << 20


@pytest.fixture
def bucket(s3: S3Server) -> str:
    return s3.bucket()


def open_s3(s3: S3Server, bucket: str, tmp_path: Path) -> S3Store:
    """The store of box1's run1 in `bucket`, reached with the credentials file."""
    st = open_store(s3.url(bucket), ("box1", "run1"), credentials=write_credentials(tmp_path / "creds"))
    assert isinstance(st, S3Store)
    return st


@pytest.fixture
def store(s3: S3Server, bucket: str, tmp_path: Path) -> Iterator[S3Store]:
    st = open_s3(s3, bucket, tmp_path)
    try:
        yield st
    finally:
        st.close()


def keys(s3: S3Server, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket).get("Contents", []))


def uploads(s3: S3Server, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


@pytest.mark.parametrize("size", [0, 1, 8 * MIB, 20 * MIB + 3])
def test_a_copy_is_invisible_until_commit_then_proven_by_a_full_reread(
    s3: S3Server, bucket: str, store: S3Store, tmp_path: Path, size: int
) -> None:
    src = write_random(tmp_path / "ckpt.bin", size)
    staged = store.stage(src, "cell-a/ckpt.bin")
    assert (staged.size, staged.digest) == (size, blake3.blake3(src.read_bytes()).hexdigest())
    assert keys(s3, bucket) == [] and not store.exists("cell-a/ckpt.bin")
    assert uploads(s3, bucket) == ["durable/box1/run1/cell-a/ckpt.bin"]
    assert store.commit(staged) is None
    key = "durable/box1/run1/cell-a/ckpt.bin"
    assert keys(s3, bucket) == [key] and uploads(s3, bucket) == []
    obj = s3.client().get_object(Bucket=bucket, Key=key)
    assert obj["Body"].read() == src.read_bytes()
    tags = s3.client().get_object_tagging(Bucket=bucket, Key=key)["TagSet"]
    # Labelled by tags, not by copying the whole object onto itself for metadata (as slow as the upload).
    assert {t["Key"]: t["Value"] for t in tags} == {"blake3": staged.digest, "size": str(size)}
    assert store.verify("cell-a/ckpt.bin", staged.digest)


def test_an_object_overwritten_behind_the_stores_back_fails_the_proof(
    s3: S3Server, bucket: str, store: S3Store, tmp_path: Path
) -> None:
    src = write_random(tmp_path / "ckpt.bin", 3 * MIB)
    staged = store.stage(src, "ckpt.bin")
    store.commit(staged)
    key = "durable/box1/run1/ckpt.bin"
    head = s3.client().head_object(Bucket=bucket, Key=key)
    # Same size, same metadata claiming the right digest: only the bytes differ.
    s3.client().put_object(Bucket=bucket, Key=key, Body=os.urandom(3 * MIB), Metadata=head["Metadata"])
    assert not store.verify("ckpt.bin", staged.digest)
    s3.client().delete_object(Bucket=bucket, Key=key)
    assert not store.verify("ckpt.bin", staged.digest)  # gone: not proven, not an error


def test_discard_and_a_changed_source_leave_no_upload(
    s3: S3Server, bucket: str, store: S3Store, tmp_path: Path
) -> None:
    src = write_random(tmp_path / "ckpt.bin", 10 * MIB)
    store.discard(store.stage(src, "a.bin"))
    assert uploads(s3, bucket) == [] and keys(s3, bucket) == []

    def grow(copied: int) -> None:  # the trainer writes on while the copy is read
        if copied == 8 * MIB:
            with open(src, "ab") as f:
                f.write(b"more")

    with pytest.raises(ChangedError):
        store.stage(src, "b.bin", progress=grow)
    assert uploads(s3, bucket) == [] and keys(s3, bucket) == []


def test_uploads_left_by_a_crash_are_aborted_at_start_and_only_ours(
    s3: S3Server, bucket: str, store: S3Store, tmp_path: Path
) -> None:
    src = write_random(tmp_path / "ckpt.bin", 2 * MIB)
    store.stage(src, "a.bin")  # staged, never committed: the sidecar was killed
    store.stage(src, "b.bin")
    stranger = s3.client().create_multipart_upload(Bucket=bucket, Key="elsewhere/x.bin")
    again = open_s3(s3, bucket, tmp_path)  # the sidecar started again
    try:
        assert again.clean_tmp() == 2
    finally:
        again.close()
    assert uploads(s3, bucket) == ["elsewhere/x.bin"]
    s3.client().abort_multipart_upload(Bucket=bucket, Key="elsewhere/x.bin", UploadId=stranger["UploadId"])
    staged = store.stage(src, "c.bin")
    with pytest.raises(PreconditionError):  # only the store that staged a copy may use it
        again.commit(staged)
    with pytest.raises(PreconditionError):
        store.commit(dataclasses.replace(staged, handle="an upload id given as text"))
    store.discard(staged)
    assert uploads(s3, bucket) == []


def test_the_store_id_and_owner_are_written_once(
    s3: S3Server, bucket: str, store: S3Store, tmp_path: Path
) -> None:
    first = store.store_id()
    other = open_s3(s3, bucket, tmp_path)
    try:
        assert other.store_id() == first  # the same bucket prefix: the same store
        store.bind_owner("ledger-1")
        other.bind_owner("ledger-1")
        with pytest.raises(ConfigError, match="another run"):
            other.bind_owner("ledger-2")
    finally:
        other.close()
    s3.client().delete_object(Bucket=bucket, Key="durable/box1/run1/.boxwarden-store-id")
    assert store.store_id() != first  # an emptied store is another store


def test_an_old_copy_is_kept_aside_never_deleted(
    s3: S3Server, bucket: str, store: S3Store, tmp_path: Path
) -> None:
    old = write_random(tmp_path / "old.bin", MIB)
    store.commit(store.stage(old, "cell-a/best.bin"))
    where = store.keep_aside("cell-a/best.bin", "retired-7")
    assert where == ".boxwarden-attic/retired-7/cell-a/best.bin"
    assert store.keep_aside("cell-a/best.bin", "retired-7") == where  # again: where it already lies
    new = write_random(tmp_path / "new.bin", MIB)
    staged = store.stage(new, "cell-a/best.bin")
    store.commit(staged)
    got = s3.client().get_object(Bucket=bucket, Key=f"durable/box1/run1/{where}")["Body"].read()
    assert got == old.read_bytes() and store.verify("cell-a/best.bin", staged.digest)
    store.commit(store.stage(new, "cell-b/best.bin"))
    store.keep_aside("cell-b/best.bin", "retired-8")
    other = write_random(tmp_path / "other.bin", MIB)
    store.commit(store.stage(other, "cell-b/best.bin"))
    with pytest.raises(StorageError, match="taken already"):
        store.keep_aside("cell-b/best.bin", "retired-8")
    assert store.exists("cell-b/best.bin")  # refused: the copy stays where it was
    # A keep_aside killed between its copy and its delete left both: the next one finishes it.
    store.commit(store.stage(new, "cell-c/best.bin"))
    s3.client().copy_object(
        Bucket=bucket,
        Key="durable/box1/run1/.boxwarden-attic/retired-9/cell-c/best.bin",
        CopySource={"Bucket": bucket, "Key": "durable/box1/run1/cell-c/best.bin"},
    )
    assert store.keep_aside("cell-c/best.bin", "retired-9") == ".boxwarden-attic/retired-9/cell-c/best.bin"
    assert not store.exists("cell-c/best.bin")


def test_s3_failures_are_storage_errors_that_name_the_object_and_never_the_secret(
    s3: S3Server, tmp_path: Path
) -> None:
    creds = write_credentials(tmp_path / "creds")
    missing = open_store(s3.url("no-such-bucket-bwt"), ("b", "r"), credentials=creds)
    try:
        with pytest.raises(StorageError, match="NoSuchBucket") as e:
            missing.stage(write_random(tmp_path / "x.bin", 10), "x.bin")
        assert "s3://no-such-bucket-bwt/durable/b/r/x.bin" in str(e.value)
        assert e.value.reason == "NOT_MOUNTED"
    finally:
        missing.close()
    dead = open_store("s3://bkt/p?endpoint_url=http://127.0.0.1:9&region=us-east-1", (), credentials=creds)
    try:
        with pytest.raises(StorageError) as e:
            dead.exists("x.bin")
        assert e.value.reason == "NETWORK"
        for secret in (SECRET, KEY_ID):
            assert secret not in str(e.value)
    finally:
        dead.close()


def test_the_credentials_file_is_read_without_ever_showing_it(tmp_path: Path) -> None:
    good = write_credentials(tmp_path / "good")
    assert read_credentials(good) == {"aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET}
    bad = tmp_path / "bad"
    for text, why in (
        (f"aws_secret_access_key = {SECRET}\n", "cannot be read"),  # no section header
        (f"[other]\naws_secret_access_key = {SECRET}\n", "no [default] section"),
        (f"[default]\naws_secret_access_key = {SECRET}\n", "needs aws_access_key_id"),
    ):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(why)) as e:
            read_credentials(bad)
        assert SECRET not in str(e.value)


def test_urls_and_part_sizes(tmp_path: Path) -> None:
    for url, why in (
        ("s3://bkt/p?acl=public-read", "unknown option 'acl'"),
        ("s3://bkt/p?addressing_style=odd", "addressing_style"),
        ("s3:///p", "expected s3://BUCKET"),
        ("s3://bkt/a/../b", "'.' or '..'"),
        (f"s3://{KEY_ID}:{SECRET}@bkt/p", "credentials never go in the URL"),  # the secret holds a '/'
    ):
        with pytest.raises(ConfigError, match=why) as e:
            open_store(url)
        assert SECRET not in str(e.value)
    with pytest.raises(ConfigError, match="for s3:// stores"):
        open_store((tmp_path / "d").as_uri(), credentials=write_credentials(tmp_path / "creds"))
    assert part_size(0) == part_size(70 << 30) == 8 * MIB
    for size in (80 << 30, 1 << 40, 5 << 40):
        assert -(-size // part_size(size)) < MAX_PARTS and part_size(size) % MIB == 0


def test_the_kind_of_an_s3_failure_is_named(store: S3Store) -> None:
    """PUSH_FAILED leads with the kind: throttling, permissions, credentials (errors as botocore
    builds them from S3's answers; moto throttles nothing)."""
    from botocore.exceptions import ClientError

    def answer(code: str, status: int) -> ClientError:
        return ClientError(
            {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "op"
        )

    for code, status, reason in (
        ("SlowDown", 503, "THROTTLED"),
        ("Whatever", 429, "THROTTLED"),
        ("AccessDenied", 403, "PERMISSION"),
        ("InvalidAccessKeyId", 403, "CREDENTIALS"),
        ("XMinioStorageFull", 507, "NO_SPACE"),
        ("InternalError", 500, "STORE_ERROR"),
    ):
        err = store._failure("uploading a part of", "k", answer(code, status))
        assert err.reason == reason and code in str(err) and "s3://" in str(err)


def test_a_server_checksum_proof_is_named_weaker_and_still_catches_other_bytes(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    url = s3.url(bucket) + "&proof=server-checksum"
    store = open_store(url, ("box1", "run1"), credentials=write_credentials(tmp_path / "creds"))
    try:
        src = write_random(tmp_path / "ckpt.bin", 20 * MIB + 5)  # three parts, the last one short
        staged = store.stage(src, "ckpt.bin")
        store.commit(staged)
        key = "durable/box1/run1/ckpt.bin"
        head = s3.client().head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        # The server's own CRC-32 of the whole object is the one combined from the parts' CRCs.
        assert (
            head["ChecksumCRC32"]
            == base64.b64encode(zlib.crc32(src.read_bytes()).to_bytes(4, "big")).decode()
        )
        assert store.verify("ckpt.bin", staged.digest) == "server-checksum"
        assert store.verify("ckpt.bin", staged.digest, reread=True) == "reread"
        assert store.read("ckpt.bin", 20 * MIB, 1 * MIB) == src.read_bytes()[20 * MIB :]
        assert store.read("ckpt.bin", 0, 10) == src.read_bytes()[:10]
        # Other bytes with our metadata copied onto them: the server's checksum is not ours.
        meta = head["Metadata"]
        s3.client().put_object(
            Bucket=bucket, Key=key, Body=os.urandom(20 * MIB + 5), Metadata=meta, ChecksumAlgorithm="CRC32"
        )
        assert store.verify("ckpt.bin", staged.digest) is None
        # Other bytes with no checksum at all: the proof falls back to a re-read, which fails.
        s3.client().put_object(Bucket=bucket, Key=key, Body=os.urandom(20 * MIB + 5), Metadata=meta)
        assert store.verify("ckpt.bin", staged.digest) is None
        s3.client().put_object(Bucket=bucket, Key=key, Body=src.read_bytes(), Metadata=meta)
        assert store.verify("ckpt.bin", staged.digest) == "reread"  # right bytes, no server CRC
        with pytest.raises(StorageError) as e:
            store.read("gone.bin", 0, 1)
        assert e.value.reason == "NOT_FOUND"
    finally:
        store.close()
    with pytest.raises(ConfigError, match="proof must be"):
        open_store(s3.url(bucket) + "&proof=trust-me")


def test_crc32_of_parts_combines_to_the_whole() -> None:
    rng = random.Random(7)
    for _ in range(40):
        chunks = [rng.randbytes(rng.choice([0, 1, 7, 4096, 70_001])) for _ in range(rng.randint(0, 7))]
        assert crc.combine([(zlib.crc32(c), len(c)) for c in chunks]) == zlib.crc32(b"".join(chunks))


def test_s3_parts_pushed_ahead_are_kept_or_sent_again_by_their_crc(s3: S3Server, tmp_path: Path) -> None:
    """Speculative streaming into a multipart upload (tests/sidecar/test_ahead.py has the rest)."""
    bucket = s3.bucket()
    store = open_store(s3.url(bucket), ("b", "r"), credentials=write_credentials(tmp_path / "creds"))
    src = tmp_path / "ckpt.bin"
    with open(src, "wb") as w:
        w.write(os.urandom(20 * MIB))
        w.flush()
        st = os.fstat(w.fileno())
        ahead = store.begin_ahead("ckpt.bin", (st.st_dev, st.st_ino))
        fd = os.open(src, os.O_RDONLY)
        store.push_ahead(ahead, fd, 20 * MIB)
        os.close(fd)
        assert ahead.done == 16 * MIB  # two whole 8 MiB parts
        w.seek(9 * MIB)
        w.write(b"changed")
        w.truncate(17 * MIB)  # and it shrank: no part past its end may stay
    staged = store.stage(src, "ckpt.bin", ahead=ahead)
    store.commit(staged)
    assert staged.digest == blake3.blake3(src.read_bytes()).hexdigest()
    assert store.verify("ckpt.bin", staged.digest) == "reread"
    body = s3.client().get_object(Bucket=bucket, Key="durable/b/r/ckpt.bin")["Body"].read()
    assert body == src.read_bytes()
    store.close()


# --- a real sidecar pushing to the bucket ---------------------------------------------------------


def test_a_sidecar_proves_its_copies_in_the_bucket_and_its_credentials_never_show(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    creds = write_credentials(tmp_path / "creds")
    with running(tmp_path / "box", durable_url=s3.url(bucket), durable_credentials_file=str(creds)) as d:
        assert d.proc is not None
        save_ckpt(d.watch / "cell-a" / "best.pt", seed=1)
        (d.watch / "cell-a" / "metrics.json").write_text('{"loss": 0.5}')
        claims = {c.path: c for c in d.wait_durable(2)}
        hello = d.stub.Hello(pb.HelloRequest(), timeout=10)
        run = hello.run_id
        for path, claim in claims.items():
            body = s3.client().get_object(Bucket=bucket, Key=f"durable/t1/{run}/{path}")["Body"].read()
            assert (
                blake3.blake3(body).hexdigest()
                == claim.blake3
                == blake3.blake3((d.watch / path).read_bytes()).hexdigest()
            )
        # Overwritten behind the sidecar's back: a release re-reads and refuses to delete anything.
        s3.client().put_object(
            Bucket=bucket, Key=f"durable/t1/{run}/cell-a/metrics.json", Body=b'{"loss": 9}'
        )
        digest = d.listing().manifest_digest
        resp = d.stub.ReleaseArtifacts(pb.ReleaseArtifactsRequest(manifest_digest=digest), timeout=60)
        assert list(resp.deleted) == []
        assert [(r.code, r.path) for r in resp.refused] == [("NOT_DURABLE", "cell-a/metrics.json")]
        assert (d.watch / "cell-a" / "metrics.json").exists() and (d.watch / "cell-a" / "best.pt").exists()
        # The claim lost its durable mark; the push retry proves a good copy again.
        again = {c.path: c for c in d.wait_durable(2)}
        key = f"durable/t1/{run}/cell-a/metrics.json"
        body = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
        assert blake3.blake3(body).hexdigest() == again["cell-a/metrics.json"].blake3
        seen = [
            Path(f"/proc/{d.proc.pid}/cmdline").read_bytes().decode(errors="replace"),
            d.config.read_text(),
        ]
        seen += [
            p.read_text(errors="replace")
            for p in [*d.state.rglob("*.log"), d.root / "sidecar.log"]
            if p.is_file()
        ]
        seen += [str(e) for e in d.events()]
        for text in seen:
            assert SECRET not in text and KEY_ID not in text
    assert uploads(s3, bucket) == []


KILLS = int(os.environ.get("BOXWARDEN_CRASH_ROUNDS", "3"))  # `make crash`: 50, as the issue asks


def test_kill9_while_pushing_to_a_bucket_never_leaves_a_false_durable_claim_nor_an_upload(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    """As tests/sidecar/test_crash.py for file://: kill -9 at random moments of multipart pushes,
    restart; every claim the ledger on disk calls durable hashes equal in the bucket, right after
    each kill and at the end, when no upload of the store is left either (a restart aborts them)."""
    rng = random.Random(4321)
    creds = write_credentials(tmp_path / "creds")
    payload = os.urandom(20 * MIB)  # three parts

    def no_false_durable() -> int:
        rows = durable_claims(d.state / "ledger.sqlite")
        for path, digest in rows:
            body = s3.client().get_object(Bucket=bucket, Key=f"durable/t1/default/{path}")["Body"].read()
            assert blake3.blake3(body).hexdigest() == digest, f"{path} is claimed durable with other bytes"
        return len(rows)

    with short_dir() as sock_dir:
        d = make_daemon(
            tmp_path / "box", sock_dir, durable_url=s3.url(bucket), durable_credentials_file=str(creds)
        )
        d.start()
        try:
            for i in range(KILLS):
                for target in (d.watch / "latest.bin", d.watch / f"step-{i}.bin"):
                    tmp = target.with_name(target.name + ".tmp")
                    tmp.write_bytes(payload[i:] + payload[:i])
                    os.replace(tmp, target)
                time.sleep(rng.uniform(0.0, 0.8))  # the random moment of the kill, not a wait for a result
                d.kill(signal.SIGKILL)
                no_false_durable()
                d.start()
                no_false_durable()
            expected = KILLS + 1  # latest.bin once, and each step-i.bin
            d.wait_durable(expected, timeout=180)
            assert no_false_durable() == expected
            assert uploads(s3, bucket) == [], (
                "a killed push's upload is aborted when the sidecar starts again"
            )
        finally:
            d.kill(signal.SIGTERM)
