"""A box's durable copies read from this machine, for when the box or its sidecar is gone: the
source of `pull NAME --from durable`, and the proof `down NAME --box-gone` takes again before the
meter stop.

Which claims: those of the last claims list the controller received from the box
(`controller.lastlist`). Only a claim that list marked durable has a copy to read; any other is
reported and never placed, and the pull fails closed naming it. Where: the copy of artifact path P
lies at `<dir>/<box>/<run id>/<P>` in a file:// store and at the key `<prefix>/<box>/<run id>/<P>`
in an s3:// one (`durable.corner`). Nothing else of the run's corner is ever read (the store's
temp dir, its attic, its id and owner files: `durable.STORE_NAMES`). In a directory every path is
opened from the store's directory down without following a symlink; a bucket is read with boto3
(the `s3` extra), with the keys of `--durable-credentials FILE` (0600, the `[default]` section, as
for `up`) or boto3's own sources. Every byte is hashed as it arrives, and a copy is placed only if
its size and blake3 equal the claim; at most one byte more than the claim is ever read.
"""

from __future__ import annotations

import asyncio
import configparser
import errno
import os
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import durable, parts
from controller.digest import StreamHasher
from controller.errors import Reason, StateError, TransferError, Unavailable, UsageError
from controller.lastlist import DurablePull, LastList
from controller.manifest import path_problem
from controller.parts import DIR_FLAGS
from controller.pathtext import check_path_text
from controller.pull import IN_FLIGHT, Progress, PullReport, in_flight, pull_claims
from controller.state import Box, State

CHUNK = 4 << 20
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Piece:
    offset: int
    data: bytes


class Reader(Protocol):
    """The durable copies of one run, read from here."""

    where: str  # the run's corner, for messages

    def read(self, path: str, offset: int, limit: int) -> AsyncIterator[Piece]:
        """At most `limit` bytes of the copy of `path` from `offset`, in order; Unavailable if there
        is no such copy (or it is no plain file), TransferError if it cannot be read now."""
        ...

    async def close(self) -> None: ...


def last_list(state: State, box: Box) -> LastList:
    """The box's last claims list, if it is of the box's current run; StateError saying what to do."""
    last = state.last_list(box.name)
    if last is None:
        raise StateError(
            f"no claims list was ever received from {box.name}, so nothing says which durable copies are "
            f"its claims; a list is kept each time `pull`, `artifacts` or `down` reaches the box"
        )
    if last.run_id != box.run_id:
        raise StateError(
            f"the last claims list received from {box.name} is of run {last.run_id}, and the box runs "
            f"{box.run_id}: no list of this run was ever received"
        )
    return last


async def pull_durable(
    state: State, box: Box, to: Path, progress: Progress | None, credentials: Path | None
) -> PullReport:
    """Pull the claims of the box's last claims list from its durable store into `to` (see
    `controller.pull`); on success the tree is recorded as the box's pulled tree and as a pull of
    that list from durable storage (what `down --box-gone` asks for)."""
    check_path_text(to.resolve(), "the pull target")
    last = last_list(state, box)
    reader = open_reader(last, box, credentials)
    try:
        rep = await pull_claims(
            DurableSource(reader, last),
            last.listing,
            last.hello,
            root=to,
            run_id=box.run_id,
            instance=box.name,
            roster=box.roster,
            progress=progress,
        )
    finally:
        await reader.close()
    rep.source_detail = f"{reader.where}, the claims of {last.describe()}"
    state.set_pulled_dir(box.name, str(rep.root))
    state.record_durable_pull(
        DurablePull(
            box.name, last.run_id, last.manifest_digest, last.received_at_ns, str(rep.root), time.time_ns()
        )
    )
    return rep


class DurableSource:
    name = "durable"

    def __init__(self, reader: Reader, last: LastList) -> None:
        self.reader, self.last = reader, last

    async def fetch(
        self, claim: pb.Claim, parts_fd: int, progress: Progress | None, report: PullReport
    ) -> int:
        if not claim.durable:
            raise Unavailable(
                f"not durable in the last claims list (received at {self.last.received_at}): "
                f"no proven copy to read ({claim.push_error or 'push not proven yet'})"
            )
        start = parts.part_size(parts_fd, claim)
        if start:
            report.resumed[claim.path] = start
        restarted = False
        while True:
            try:
                offset, total, digest = await parts.receive(claim, parts_fd, progress, self._stream(claim))
            except Unavailable:
                if not parts.part_size(parts_fd, claim):
                    parts.drop(parts_fd, claim)  # made for this attempt, nothing in it
                raise
            if total == claim.size and digest == claim.blake3:
                return total - start
            if offset and not restarted:  # the bytes kept from before may be what is wrong
                parts.restart(parts_fd, claim, report, total - start)
                start, restarted = 0, True
                continue
            parts.drop(parts_fd, claim)
            raise Unavailable(
                f"its durable copy in {self.reader.where} holds {total if total <= claim.size else 'more'} "
                f"bytes hashing {digest[:12]}…, the claim is {claim.size} bytes {claim.blake3[:12]}…: "
                "never placed"
            )

    def _stream(self, claim: pb.Claim) -> parts.Stream:
        def read(offset: int) -> AsyncIterator[Piece]:
            # One byte past the claim's end says that the copy is longer, without reading all of it.
            return self.reader.read(claim.path, offset, claim.size + 1 - offset)

        return read


async def reprove(last: LastList, reader: Reader) -> list[Reason]:
    """Read every claim's durable copy back whole and hash it: the reasons (NOT_DURABLE) for each
    that is missing, of other bytes, or not durable in the list; empty when every copy equals its
    claim."""
    problems: dict[str, str] = {}

    async def one(claim: pb.Claim) -> None:
        if not claim.durable:
            problems[claim.path] = "not durable in the last claims list: no proven copy"
            return
        hasher = StreamHasher()
        try:
            async for piece in reader.read(claim.path, 0, claim.size + 1):
                await asyncio.to_thread(hasher.update, piece.data)
        except TransferError as e:  # Unavailable included: no copy, or none that can be read
            problems[claim.path] = f"its durable copy cannot be read back: {e}"
            return
        if (hasher.bytes_seen, hasher.hexdigest()) != (claim.size, claim.blake3):
            problems[claim.path] = (
                f"its durable copy in {reader.where} no longer hashes to the claim (read back "
                f"{hasher.bytes_seen} bytes, {hasher.hexdigest()[:12]}…; the claim is {claim.size} bytes "
                f"{claim.blake3[:12]}…)"
            )

    await in_flight(list(last.listing.claims), one, IN_FLIGHT)
    return [Reason("NOT_DURABLE", path=p, detail=problems[p]) for p in sorted(problems)]


def open_reader(last: LastList, box: Box, credentials: Path | None) -> Reader:
    """The reader of the run's corner in the box's durable store, from this machine."""
    scope = (last.box, last.run_id)
    where = durable.corner(last.durable_url, scope)
    if isinstance(where, Path):
        if credentials is not None:
            raise UsageError(
                "--durable-credentials goes with an s3:// durable store (a directory needs none)"
            )
        if not where.is_dir():
            on_box = (
                f" It lies on the box {box.host}: mount that volume here at the same path, then try again."
                if box.host
                else ""
            )
            raise UsageError(
                f"the durable copies of {box.name} should lie in {where}, which is no directory here.{on_box}"
            )
        store_dir = where.parents[len(scope) - 1]  # the durable URL's own directory
        return FileReader(store_dir, scope)
    return S3Reader.open(where, durable.read_credentials(credentials) if credentials is not None else None)


def _safe_parts(path: str) -> list[str]:
    problem = path_problem(path)
    names = path.split("/")
    if problem is None and names[0] in durable.STORE_NAMES:
        problem = "the durable store's own name"
    if problem is not None:
        raise Unavailable(f"{path!r} is not an artifact path ({problem}): never read")
    return names


class FileReader:
    """Copies in a directory: each path opened from the corner down, never through a symlink."""

    def __init__(self, base: Path, scope: tuple[str, ...]) -> None:
        """`base`: the store's directory (the durable URL's; a symlink there is the operator's
        choice, as for the sidecar); `scope`: the box's name and the run id below it."""
        self.base, self.scope = base, scope
        self.root = base.joinpath(*scope)
        self.where = str(self.root)

    async def read(self, path: str, offset: int, limit: int) -> AsyncIterator[Piece]:
        fd = await asyncio.to_thread(self._open, path)
        try:
            end = offset + limit
            while offset < end:
                data = await asyncio.to_thread(os.pread, fd, min(CHUNK, end - offset), offset)
                if not data:
                    return
                yield Piece(offset, data)
                offset += len(data)
        except OSError as exc:
            raise TransferError(f"{self.root / path}: cannot be read: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)

    def _open(self, path: str) -> int:
        *dirs, name = _safe_parts(path)
        full = self.root / path
        try:
            fd = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise TransferError(f"{self.base}: cannot be opened: {exc.strerror or exc}") from exc
        try:
            for d in (*self.scope, *dirs):
                nxt = os.open(d, DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
            out = os.open(name, _FILE_FLAGS, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise Unavailable(f"no durable copy at {full}") from exc
            if exc.errno == errno.ELOOP:
                raise Unavailable(f"{full} (or a directory above it) is a symlink: never followed") from exc
            raise TransferError(f"{full}: cannot be opened: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        if not stat.S_ISREG(os.fstat(out).st_mode):
            os.close(out)
            raise Unavailable(f"{full} is not a regular file")
        # What is read proves the device's bytes, not a cached page (as the sidecar's own proof).
        os.posix_fadvise(out, 0, 0, os.POSIX_FADV_DONTNEED)
        return out

    async def close(self) -> None:
        return None


def s3_keys(text: str) -> dict[str, str]:
    """boto3's keyword arguments from a credentials file's text (its `[default]` section, the
    format `up --durable-credentials` takes). Nothing of the text is ever shown."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text)
    except configparser.Error:
        raise UsageError("--durable-credentials: not an INI file with a [default] section") from None
    sec = parser["default"] if parser.has_section("default") else {}
    wanted = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")
    keys = {k: str(sec.get(k, "")).strip() for k in wanted}
    if not keys["aws_access_key_id"] or not keys["aws_secret_access_key"]:
        raise UsageError(
            "--durable-credentials: give aws_access_key_id and aws_secret_access_key in [default]"
        )
    return {k: v for k, v in keys.items() if v}


class S3Reader:
    """Copies in a bucket: ranged GETs of `prefix + path`, each failure named by the object and
    S3's error code (never the request, which may carry signed credentials)."""

    def __init__(self, client: Any, bucket: durable.Bucket, errors: tuple[type[BaseException], ...]) -> None:
        self._client, self.bucket, self._errors = client, bucket, errors
        self._broken: tuple[type[BaseException], ...] = (*errors, OSError)  # a body that stops halfway
        self.where = f"s3://{bucket.name}/{bucket.prefix}"

    @classmethod
    def open(cls, bucket: durable.Bucket, credentials: str | None) -> S3Reader:
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError, ClientError
        except ImportError:
            raise UsageError(
                "reading an s3:// durable store from here needs boto3: pip install 'boxwarden[s3]'"
            ) from None
        keys = s3_keys(credentials) if credentials is not None else {}
        session = boto3.session.Session(**keys, region_name=bucket.region)
        client = session.client(
            "s3",
            endpoint_url=bucket.endpoint_url,
            config=Config(
                s3={"addressing_style": bucket.addressing_style},
                retries={"max_attempts": 5, "mode": "adaptive"},
                connect_timeout=15,
                read_timeout=60,
                max_pool_connections=2 * IN_FLIGHT,
                # The proof here is the blake3 of every byte read; botocore's own checksums are
                # asked for only where a request needs one (S3-compatibles mangle the defaults).
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        return cls(client, bucket, (BotoCoreError, ClientError))

    async def read(self, path: str, offset: int, limit: int) -> AsyncIterator[Piece]:
        key = self.bucket.prefix + "/".join(_safe_parts(path))
        if limit <= 0:
            return
        body = await asyncio.to_thread(self._get, key, offset, limit)
        if body is None:
            return
        try:
            while True:
                data = await asyncio.to_thread(self._call, key, body.read, CHUNK)
                if not data:
                    return
                yield Piece(offset, data)
                offset += len(data)
        finally:
            body.close()

    def _get(self, key: str, offset: int, limit: int) -> Any:
        """The body of the object's bytes [offset, offset + limit); None past its end."""
        try:
            r = self._client.get_object(
                Bucket=self.bucket.name, Key=key, Range=f"bytes={offset}-{offset + limit - 1}"
            )
        except self._errors as exc:
            code = _code(exc)
            if code in ("NoSuchKey", "404", "NotFound"):
                raise Unavailable(f"no durable copy at s3://{self.bucket.name}/{key}") from None
            if code in ("InvalidRange", "416"):
                return None  # nothing at or after `offset`: the copy ends there
            raise TransferError(f"reading s3://{self.bucket.name}/{key} failed: {code}") from None
        return r["Body"]

    def _call(self, key: str, read: Any, n: int) -> bytes:
        try:
            data: bytes = read(n)
        except self._broken as exc:
            raise TransferError(
                f"reading s3://{self.bucket.name}/{key} broke ({_code(exc)}); run pull again to resume"
            ) from None
        return data

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
    return type(exc).__name__
