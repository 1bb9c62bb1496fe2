"""`s3://bucket/prefix` durable store: any S3-compatible object store (AWS, R2, B2, MinIO, moto).

This module owns the copy, commit and proof of one artifact in a bucket:

- stage: ONE read pass (`copier.single_pass`) whose sink uploads each chunk as one part of a
  multipart upload, with a SHA256 checksum the server checks; a part is sent from the pass's own
  buffer (bounded memory: a few parts, never the file). The upload in progress is the staged copy's
  handle: an upload is invisible until it is completed, so nothing half-sent is ever an object.
- commit: complete the upload at the artifact's key, then label the object with the claim's blake3
  and size: as tags (one small request) where the proof is a re-read, as metadata (a server-side
  copy of the object onto itself: S3 takes metadata only when an object is made) where the proof is
  the server's checksum, or where the store has no tagging.
- verify: GET the whole object and hash it; equal to the claim → proven ("reread"). With
  `?proof=server-checksum` the user accepts a cheaper, weaker proof instead: the stage also takes
  each part's CRC-32 from the same buffers, commit asks the server to compute the whole object's
  CRC-32 as it copies it onto itself (and stores ours beside the blake3 in the metadata), and
  verify is a HEAD: our metadata's blake3 equal to the claim and the server's CRC-32 equal to ours
  ("server-checksum"). Where the server gives no full-object CRC (objects over 5 GiB are copied
  by parts; some stores compute none) it falls back to the re-read.
- clean_tmp: abort every multipart upload under the store's keys (a crash leaves them behind,
  billed and invisible).

boto3 is imported only here, and this module only when a durable URL says `s3://`.

URL: `s3://BUCKET[/PREFIX][?endpoint_url=URL&region=NAME&addressing_style=path|virtual|auto
&proof=reread|server-checksum]`.
Credentials: the file given in the sidecar's config (`[default]` with `aws_access_key_id`,
`aws_secret_access_key`, optionally `aws_session_token`, as in ~/.aws/credentials), else boto3's
standard sources on the box. They never appear in a message of this module.
"""

from __future__ import annotations

import base64
import configparser
import logging
import os
import threading
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from sidecar import hashing
from sidecar.compat import SLOTS
from sidecar.errors import ConfigError, PreconditionError, StorageError
from sidecar.priority import lower_this_thread
from sidecar.probes import DiskSample
from sidecar.storage import (
    ATTIC_NAME,
    ID_NAME,
    OWNER_NAME,
    REREAD,
    SERVER_CHECKSUM,
    Progress,
    StagedCopy,
    check_scope,
    check_source_unchanged,
    copier,
    crc,
    open_source,
    split_rel,
)
from sidecar.storage.copier import Ahead, single_pass
from sidecar.storage.pace import UNLIMITED, Pace

logger = logging.getLogger(__name__)

MAX_PARTS = 10_000  # S3's limit on the parts of one upload
MAX_COPY = 5 << 30  # the largest object one CopyObject may copy; larger ones are copied by parts
READ_CHUNK = 8 << 20
PARTS_IN_FLIGHT = 6
"""Parts of one upload being sent at once (each from its own buffer of the pass: 6 x 8 MiB): a
part's request waits on the network far longer than reading and hashing it takes."""

QUERY_KEYS = ("endpoint_url", "region", "addressing_style", "proof")

_S3_REASONS = {
    "SlowDown": "THROTTLED",
    "Throttling": "THROTTLED",
    "ThrottlingException": "THROTTLED",
    "RequestLimitExceeded": "THROTTLED",
    "TooManyRequests": "THROTTLED",
    "ServiceUnavailable": "THROTTLED",
    "AccessDenied": "PERMISSION",
    "AllAccessDisabled": "PERMISSION",
    "InvalidAccessKeyId": "CREDENTIALS",
    "SignatureDoesNotMatch": "CREDENTIALS",
    "ExpiredToken": "CREDENTIALS",
    "InvalidToken": "CREDENTIALS",
    "NoSuchBucket": "NOT_MOUNTED",
    "QuotaExceeded": "QUOTA",
    "StorageQuotaExceeded": "QUOTA",
    "XMinioStorageFull": "NO_SPACE",
}
_HTTP_REASONS = {429: "THROTTLED", 503: "THROTTLED", 403: "PERMISSION", 507: "NO_SPACE"}


def part_size(size: int) -> int:
    """The chunk (= part) size of the pass for a file of `size` bytes: the stage chunk, or larger so
    that the parts stay under S3's 10,000 (a 1 TiB checkpoint takes 105 MiB parts)."""
    need = -(-size // (MAX_PARTS - 1))
    mib = 1 << 20
    return max(hashing.STAGE_CHUNK, -(-need // mib) * mib)


@dataclass(**SLOTS)
class _Upload:
    """A multipart upload in progress: the handle of a copy staged in an S3 store."""

    store: int  # id() of the store that made it
    key: str
    upload_id: str
    chunk: int
    parts: dict[int, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Each part's (CRC-32, length), computed while uploading it, when the proof is the server's
    # checksum: the object's CRC-32 is combined from them at commit.
    crcs: dict[int, tuple[int, int]] | None = None


class _PartSink:
    """Each chunk of the pass becomes the part at its offset (all chunks but the last are full)."""

    def __init__(
        self, s3: S3Store, up: _Upload, ahead: Ahead | None = None, *, recording: bool = False
    ) -> None:
        """`ahead`, `recording`: as for the file store's sink (a push ahead of the seal, or the seal)."""
        self._s3, self._up = s3, up
        self._ahead, self._recording = ahead, recording

    def already(self, data: memoryview, offset: int) -> bool:
        return self._ahead is not None and not self._recording and self._ahead.matches(data, offset)

    def write(self, data: memoryview, offset: int) -> None:
        number = offset // self._up.chunk + 1
        if self._up.crcs is not None:
            crc = zlib.crc32(data)  # the same buffer blake3 hashed: one read pass
            with self._up.lock:
                self._up.crcs[number] = (crc, len(data))
        r = self._s3.call(
            "uploading a part of",
            self._up.key,
            "upload_part",
            Key=self._up.key,
            UploadId=self._up.upload_id,
            PartNumber=number,
            Body=bytes(data),
            ChecksumAlgorithm="SHA256",
        )
        with self._up.lock:
            self._up.parts[number] = {
                "PartNumber": number,
                "ETag": r["ETag"],
                "ChecksumSHA256": r["ChecksumSHA256"],
            }
        if self._recording and self._ahead is not None:
            self._ahead.record(data, offset)

    def written(self, end: int) -> None:
        pass

    def alone(self, n: int) -> bool:
        return False


def _crc_text(value: int) -> str:
    """A CRC-32 as S3 writes it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def read_credentials(path: Path) -> dict[str, str]:
    """boto3's keyword arguments from a credentials file (its `[default]` section)."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except (OSError, UnicodeDecodeError, configparser.Error) as exc:
        # The parser's message may quote the file's lines: never pass it on.
        raise ConfigError(
            f"the credentials file {path} cannot be read as [default] with keys ({type(exc).__name__})"
        ) from None
    if not parser.has_section("default"):
        raise ConfigError(f"the credentials file {path} has no [default] section")
    sec = parser["default"]
    keys = {
        k: sec[k].strip()
        for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
        if sec.get(k, "").strip()
    }
    if "aws_access_key_id" not in keys or "aws_secret_access_key" not in keys:
        raise ConfigError(
            f"the credentials file {path} needs aws_access_key_id and aws_secret_access_key in [default]"
        )
    return keys


class S3Store:
    """A durable store under one key prefix of one bucket. Thread-safe."""

    def __init__(
        self, client: Any, bucket: str, prefix: str, *, url: str, proof: str = REREAD, pace: Pace = UNLIMITED
    ) -> None:
        """`prefix` is "" or ends with "/"; every key of the store starts with it. `proof`: how
        verify proves a copy by default (REREAD, or SERVER_CHECKSUM where the user opted in).
        `pace`: the byte rate uploads and re-reads keep to (`storage.pace`)."""
        self._client, self.bucket, self.prefix, self.url = client, bucket, prefix, url
        self.proof = proof
        self._pace = pace
        self._pool = ThreadPoolExecutor(
            max_workers=2 * PARTS_IN_FLIGHT, thread_name_prefix="boxwarden-s3", initializer=lower_this_thread
        )
        from botocore.exceptions import BotoCoreError, ClientError

        self._errors: tuple[type[BaseException], ...] = (BotoCoreError, ClientError)
        self._client_error = ClientError

    @classmethod
    def from_url(
        cls, url: str, scope: tuple[str, ...] = (), credentials: Path | None = None, pace: Pace = UNLIMITED
    ) -> S3Store:
        parts = urlsplit(url)
        bucket = parts.netloc
        if "@" in url or ":" in bucket:  # may carry a key and secret: never echoed
            raise ConfigError("durable URL s3://…: credentials never go in the URL; give a credentials file")
        if not bucket or parts.fragment:
            raise ConfigError(f"durable URL {url!r}: expected s3://BUCKET/PREFIX (no fragment)")
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(set(query) - set(QUERY_KEYS))
        if unknown:
            raise ConfigError(
                f"durable URL {url!r}: unknown option {unknown[0]!r}; known: {', '.join(QUERY_KEYS)}"
            )
        style = query.get("addressing_style", "auto")
        if style not in ("path", "virtual", "auto"):
            raise ConfigError(f"durable URL {url!r}: addressing_style must be path, virtual or auto")
        proof = query.get("proof", REREAD)
        if proof not in (REREAD, SERVER_CHECKSUM):
            raise ConfigError(f"durable URL {url!r}: proof must be {REREAD} or {SERVER_CHECKSUM}")
        check_scope(url, scope)
        names = [p for p in unquote(parts.path).split("/") if p]
        if any(p in (".", "..") for p in names):
            raise ConfigError(f"durable URL {url!r}: the prefix may not hold '.' or '..'")
        prefix = "".join(f"{p}/" for p in [*names, *scope])
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise ConfigError(
                f"durable URL {url!r}: the s3:// store needs boto3 on the box (pip install 'boxwarden[s3]')"
            ) from exc
        keys = read_credentials(credentials) if credentials is not None else {}
        session = boto3.session.Session(**keys, region_name=query.get("region") or None)
        client = session.client(
            "s3",
            endpoint_url=query.get("endpoint_url") or None,
            config=Config(
                s3={"addressing_style": style},
                retries={"max_attempts": 5, "mode": "adaptive"},
                connect_timeout=15,
                read_timeout=60,
                max_pool_connections=4 * PARTS_IN_FLIGHT,
                # Checksums where a request asks for them (each part's SHA256), not botocore's own
                # everywhere: many S3-compatible stores refuse or mangle those, and the proof here
                # is the blake3 of a full re-read, whatever the server says.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        base = url.split("?", 1)[0].rstrip("/")
        scoped = "/".join([base, *(quote(p) for p in scope)])
        return cls(client, bucket, prefix, url=scoped, proof=proof, pace=pace)

    # -------------------------------------------------------------------------------- requests

    def call(self, doing: str, key: str, op: str, **kw: Any) -> Any:
        """One request on the bucket; any failure is a StorageError naming the object and S3's
        error code (never the request, which may carry signed credentials)."""
        try:
            return getattr(self._client, op)(Bucket=self.bucket, **kw)
        except self._errors as exc:
            raise self._failure(doing, key, exc) from None

    def _failure(self, doing: str, key: str, exc: BaseException) -> StorageError:
        """The StorageError for a failed request, naming the object, S3's error code and the kind of
        failure (never the request, which may carry signed credentials)."""
        text, reason = self._reason(exc)
        return StorageError(f"{doing} s3://{self.bucket}/{key} failed: {text}", reason)

    def _reason(self, exc: BaseException) -> tuple[str, str]:
        name = type(exc).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return (
                f"{name}: no usable credentials; give `up --durable-credentials FILE`, or set up AWS "
                "credentials for the box's user",
                "CREDENTIALS",
            )
        if name in (
            "EndpointConnectionError",
            "ConnectTimeoutError",
            "ReadTimeoutError",
            "ConnectionClosedError",
        ):
            return (
                f"{name}: the S3 endpoint cannot be reached from the box; check endpoint_url and the network",
                "NETWORK",
            )
        if isinstance(exc, self._client_error):
            err = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(err.get("Code", "error"))
            text = f"{code} (HTTP {status}): {err.get('Message', '')}".rstrip(": ")
            return text, _S3_REASONS.get(code) or _HTTP_REASONS.get(status or 0, "STORE_ERROR")
        return name, "NETWORK" if isinstance(exc, OSError) else "STORE_ERROR"

    def _missing(self, exc: BaseException) -> bool:
        if not isinstance(exc, self._client_error):
            return False
        err = exc.response.get("Error", {})
        return str(err.get("Code")) in ("404", "NoSuchKey", "NotFound", "NoSuchUpload")

    def _head(self, key: str, *, checksums: bool = False) -> dict[str, Any] | None:
        kw = {"ChecksumMode": "ENABLED"} if checksums else {}
        try:
            return dict(self._client.head_object(Bucket=self.bucket, Key=key, **kw))
        except self._errors as exc:
            if self._missing(exc):
                return None
            raise self._failure("looking at", key, exc) from None

    def _key(self, rel: str) -> str:
        split_rel(rel)
        return self.prefix + rel

    # ----------------------------------------------------------------------------------- stage

    def stage(
        self, src: Path, rel: str, *, progress: Progress | None = None, ahead: Ahead | None = None
    ) -> StagedCopy:
        key = self._key(rel)
        try:
            before, src_fd = open_source(src)
        except BaseException:
            if ahead is not None:
                self.discard_ahead(ahead)
            raise
        try:
            chunk = part_size(before.size)
            if ahead is not None and (
                ahead.rel != rel or ahead.source != (before.dev, before.ino) or ahead.chunk != chunk
            ):
                self.discard_ahead(ahead)  # another file, or too big for the parts pushed ahead
                ahead = None
            up = self._upload_ahead(ahead) if ahead is not None else self._start_upload(key, chunk)
            try:
                digest, copied = single_pass(
                    src,
                    src_fd,
                    _PartSink(self, up, ahead),
                    self._pool,
                    chunk_size=chunk,
                    buffers=PARTS_IN_FLIGHT,
                    limit=before.size,
                    progress=progress,
                    pace=self._pace,
                )
                check_source_unchanged(src, before, src_fd, copied)
            except BaseException:
                self._abort(up)
                raise
        finally:
            os.close(src_fd)
        last = -(-copied // chunk)  # 0 for an empty file: commit then sends one empty part
        for number in [n for n in up.parts if n > last]:  # pushed ahead past where the file ends now
            del up.parts[number]
            if up.crcs is not None:
                up.crcs.pop(number, None)
        return StagedCopy(rel=rel, handle=up, digest=digest, size=copied, source=before)

    def _start_upload(self, key: str, chunk: int) -> _Upload:
        r = self.call(
            "starting an upload to", key, "create_multipart_upload", Key=key, ChecksumAlgorithm="SHA256"
        )
        up = _Upload(store=id(self), key=key, upload_id=r["UploadId"], chunk=chunk)
        if self.proof == SERVER_CHECKSUM:
            up.crcs = {}
        return up

    # ------------------------------------------------------------------- pushed ahead of the seal

    def begin_ahead(self, rel: str, source: tuple[int, int]) -> Ahead:
        """An upload to push a file into while it is still being written (see `copier.Ahead`): its
        parts are the stage's own (a file under 80 GB keeps the smallest part size)."""
        chunk = part_size(0)
        return Ahead(rel=rel, source=source, handle=self._start_upload(self._key(rel), chunk), chunk=chunk)

    def push_ahead(self, ahead: Ahead, src_fd: int, upto: int) -> None:
        sink = _PartSink(self, self._upload_ahead(ahead), ahead, recording=True)
        copier.push_ahead(ahead, Path(ahead.rel), src_fd, upto, lambda end: sink, self._pool, self._pace)

    def discard_ahead(self, ahead: Ahead) -> None:
        self._abort(self._upload_ahead(ahead))

    def _upload_ahead(self, ahead: Ahead) -> _Upload:
        up = ahead.handle
        if not isinstance(up, _Upload) or up.store != id(self) or up.key != self.prefix + ahead.rel:
            raise PreconditionError(
                f"the copy of {ahead.rel} was not pushed ahead by the store at {self.url}"
            )
        return up

    def _upload_of(self, staged: StagedCopy) -> _Upload:
        up = staged.handle
        if not isinstance(up, _Upload) or up.store != id(self) or up.key != self.prefix + staged.rel:
            raise PreconditionError(f"the copy of {staged.rel} was not staged by the store at {self.url}")
        return up

    def _abort(self, up: _Upload) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=up.key, UploadId=up.upload_id)
        except self._errors as exc:
            if not self._missing(exc):
                raise self._failure("aborting the upload to", up.key, exc) from None

    # ---------------------------------------------------------------------------------- commit

    def commit(self, staged: StagedCopy) -> str | None:
        up = self._upload_of(staged)
        try:
            if not up.parts:  # an empty file: an upload needs one part, and an empty one may be it
                _PartSink(self, up).write(memoryview(b""), 0)
            parts = [up.parts[n] for n in sorted(up.parts)]
            if [p["PartNumber"] for p in parts] != list(range(1, len(parts) + 1)):
                raise StorageError(f"the upload of {staged.rel} lacks parts: {sorted(up.parts)}")
            self.call(
                "completing the upload to",
                up.key,
                "complete_multipart_upload",
                Key=up.key,
                UploadId=up.upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            self._abort(up)
            raise
        meta = {"blake3": staged.digest, "size": str(staged.size)}
        if up.crcs is not None or not self._tag(up.key, meta):
            # The server's checksum is the proof: it computes the whole object's CRC-32 as it copies
            # the object onto itself, with our labels as metadata (and a store without tagging).
            checksum = None
            if up.crcs is not None:
                meta["crc32"] = _crc_text(crc.combine([up.crcs[n] for n in sorted(up.crcs)]))
                checksum = "CRC32"
            self._copy(up.key, up.key, staged.size, metadata=meta, checksum=checksum)
        logger.debug("committed %s (%d bytes, %s)", staged.rel, staged.size, staged.digest)
        return None  # keys have no kinds: "a" and "a/b" live side by side, nothing is ever in the way

    def _tag(self, key: str, labels: dict[str, str]) -> bool:
        """Label the object with tags (one small request); False where the store has no tagging
        (the caller then writes the labels as metadata, by copying the object onto itself)."""
        tags = {"TagSet": [{"Key": k, "Value": v} for k, v in labels.items()]}
        try:
            self.call("labelling", key, "put_object_tagging", Key=key, Tagging=tags)
        except StorageError as e:
            if "NotImplemented" in str(e) or "(HTTP 501)" in str(e):
                return False
            raise
        return True

    def _named_digest(self, key: str, head: dict[str, Any]) -> str:
        """The blake3 the object is labelled with (metadata or tag); "" if none."""
        named = (head.get("Metadata") or {}).get("blake3")
        if named:
            return str(named)
        try:
            tags = self.call("reading the labels of", key, "get_object_tagging", Key=key).get("TagSet", [])
        except StorageError:
            return ""
        return next((str(t["Value"]) for t in tags if t.get("Key") == "blake3"), "")

    def _copy(
        self,
        src: str,
        dst: str,
        size: int,
        *,
        metadata: dict[str, str] | None = None,
        checksum: str | None = None,
    ) -> None:
        """A server-side copy of the object `src` to `dst` (REPLACE the metadata when given; with
        `checksum`, the server computes the copy's full-object checksum of that algorithm)."""
        source = {"Bucket": self.bucket, "Key": src}
        extra: dict[str, Any] = {"MetadataDirective": "REPLACE", "Metadata": metadata} if metadata else {}
        if size <= MAX_COPY:
            if checksum is not None:
                extra["ChecksumAlgorithm"] = checksum
            self.call("copying to", dst, "copy_object", Key=dst, CopySource=source, **extra)
            return
        r = self.call(
            "starting a copy to",
            dst,
            "create_multipart_upload",
            Key=dst,
            **({"Metadata": metadata} if metadata else {}),
        )
        upload_id = r["UploadId"]
        chunk = max(part_size(size), 512 << 20)
        parts = []
        try:
            for i, start in enumerate(range(0, size, chunk), start=1):
                end = min(start + chunk, size) - 1
                p = self.call(
                    "copying a part to",
                    dst,
                    "upload_part_copy",
                    Key=dst,
                    UploadId=upload_id,
                    PartNumber=i,
                    CopySource=source,
                    CopySourceRange=f"bytes={start}-{end}",
                )
                parts.append({"PartNumber": i, "ETag": p["CopyPartResult"]["ETag"]})
            self.call(
                "completing the copy to",
                dst,
                "complete_multipart_upload",
                Key=dst,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            self._abort(_Upload(store=id(self), key=dst, upload_id=upload_id, chunk=chunk))
            raise

    def discard(self, staged: StagedCopy) -> None:
        self._abort(self._upload_of(staged))

    def keep_aside(self, rel: str, tag: str) -> str | None:
        key = self._key(rel)
        where = "/".join((ATTIC_NAME, tag, rel))
        aside = self.prefix + where
        head = self._head(key)
        if head is None:
            return where if self._head(aside) is not None else None
        kept = self._head(aside)
        if kept is not None:
            named = self._named_digest(key, head)
            same = kept.get("ContentLength") == head.get("ContentLength") and named != ""
            if not same or self._named_digest(aside, kept) != named:
                raise StorageError(
                    f"s3://{self.bucket}/{aside} is taken already; the old copy stays at {key}"
                )
            # A keep_aside killed between its copy and its delete: the copy is whole, finish it.
            self.call("removing the old copy at", key, "delete_object", Key=key)
            return where
        self._copy(key, aside, int(head["ContentLength"]))
        self.call("removing the old copy at", key, "delete_object", Key=key)
        logger.warning("kept the old copy at %s aside at %s: a new file took its path", rel, where)
        return where

    # ---------------------------------------------------------------------------------- verify

    def verify(self, rel: str, digest: str, *, reread: bool = False) -> str | None:
        key = self._key(rel)
        if self.proof == SERVER_CHECKSUM and not reread:
            head = self._head(key, checksums=True)
            if head is None:
                return None
            meta = head.get("Metadata") or {}
            ours, theirs = meta.get("crc32"), head.get("ChecksumCRC32")
            if meta.get("blake3") != digest or meta.get("size") != str(head.get("ContentLength")):
                logger.warning(
                    "durable copy s3://%s/%s is not the copy of claim %s", self.bucket, key, digest
                )
                return None
            if ours and theirs:
                if ours == theirs:
                    return SERVER_CHECKSUM
                logger.warning("durable copy s3://%s/%s: the server's CRC-32 is not ours", self.bucket, key)
                return None
            # No full-object checksum from the server (copied by parts, or a store without one).
        else:
            # A HEAD first: an object whose own metadata names other bytes (a failed push's
            # leftover, a copy of another claim) is not worth downloading to find out.
            head = self._head(key)
            if head is None:
                return None
            named = (head.get("Metadata") or {}).get("blake3")
            if (named and named != digest) or int(head.get("ContentLength", -1)) < 0:
                return None
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
        except self._errors as exc:
            if self._missing(exc):
                return None
            raise self._failure("re-reading", key, exc) from None
        hasher = hashing.new_hasher()
        try:
            with body:
                for chunk in iter(lambda: body.read(READ_CHUNK), b""):
                    hasher.update(chunk)
                    self._pace.take(len(chunk))
        except self._errors as exc:
            raise self._failure("re-reading", key, exc) from None
        except OSError as exc:
            raise StorageError(f"re-reading s3://{self.bucket}/{key} failed: {exc}") from None
        if hasher.hexdigest() != digest:
            logger.warning("durable copy s3://%s/%s does not hash to its claim %s", self.bucket, key, digest)
            return None
        return REREAD

    def read(self, rel: str, offset: int, length: int) -> bytes:
        key = self._key(rel)
        if length <= 0:
            return b""
        try:
            r = self._client.get_object(
                Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}"
            )
            with r["Body"] as body:
                data: bytes = body.read()
        except self._errors as exc:
            if self._missing(exc):
                raise StorageError(f"no durable copy at s3://{self.bucket}/{key}", "NOT_FOUND") from None
            if (
                isinstance(exc, self._client_error)
                and exc.response.get("Error", {}).get("Code") == "InvalidRange"
            ):
                return b""  # at or past the end
            raise self._failure("reading", key, exc) from None
        except OSError as exc:
            raise StorageError(f"reading s3://{self.bucket}/{key} failed: {exc}", "NETWORK") from None
        return data

    def exists(self, rel: str) -> bool:
        return self._head(self._key(rel)) is not None

    def space(self) -> DiskSample | None:
        return None  # a bucket has no free space to read: it says so when a write fails

    # ------------------------------------------------------------------------------- ownership

    def store_id(self) -> str:
        return self._write_once(ID_NAME, uuid.uuid4().hex)

    def bind_owner(self, owner: str) -> None:
        found = self._write_once(OWNER_NAME, owner)
        if found != owner:
            raise ConfigError(
                f"{self.url} holds the durable copies of another run (owner {found}, this ledger is "
                f"{owner}); they are never overwritten: give this box another --run-id (or durable URL)"
            )

    def _write_once(self, name: str, value: str) -> str:
        """The small object `name` under the prefix, written as `value` unless one exists: a
        conditional PUT (If-None-Match: *), so that of two writers, the first one's value holds."""
        key = self.prefix + name
        try:
            self._client.put_object(Bucket=self.bucket, Key=key, Body=value.encode() + b"\n", IfNoneMatch="*")
            return value
        except self._errors as exc:
            code = (
                str(exc.response.get("Error", {}).get("Code")) if isinstance(exc, self._client_error) else ""
            )
            if code not in ("PreconditionFailed", "ConditionalRequestConflict", "412"):
                raise self._failure("writing", key, exc) from None
        body = self.call("reading", key, "get_object", Key=key)["Body"]
        with body:
            return str(body.read().decode("ascii", "replace").strip())

    def clean_tmp(self) -> int:
        aborted = 0
        kw: dict[str, Any] = {"Prefix": self.prefix}
        while True:
            page = self.call("listing the uploads under", self.prefix, "list_multipart_uploads", **kw)
            for u in page.get("Uploads", []):
                self._abort(_Upload(store=id(self), key=u["Key"], upload_id=u["UploadId"], chunk=0))
                aborted += 1
            if not page.get("IsTruncated"):
                break
            kw.update(
                KeyMarker=page.get("NextKeyMarker", ""), UploadIdMarker=page.get("NextUploadIdMarker", "")
            )
        if aborted:
            logger.info(
                "aborted %d uploads left by a crash under s3://%s/%s", aborted, self.bucket, self.prefix
            )
        return aborted

    def close(self) -> None:
        self._pool.shutdown(wait=True)
