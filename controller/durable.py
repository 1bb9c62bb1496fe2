"""What a durable URL means on the controller's side: a directory (`file:///abs/dir`, on the box,
or on this machine for a local box) or a bucket (`s3://BUCKET/PREFIX?endpoint_url=…`). The only
controller module that knows a scheme; the sidecar's `storage` package is its box-side twin.

Credentials never ride in a URL (a URL is shown by `status`, kept in the state and in the sidecar's
config): an s3:// URL with a user or password is refused; they come from a file given to `up`
(`--durable-credentials`), which is sent to the box over the launch request's stdin and kept there
0600, or from the box's own AWS sources.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

from controller.errors import UsageError
from controller.pathtext import CONTROL

S3_OPTIONS = ("endpoint_url", "region", "addressing_style", "proof")
STORE_NAMES = frozenset({".boxwarden-tmp", ".boxwarden-store-id", ".boxwarden-owner", ".boxwarden-attic"})
"""The durable store's own names at the top of a run's corner (the sidecar's, in its RESERVED_TOP):
copies in flight, the store's id, the run's owner, and old copies moved aside. No claim is there."""
CREDENTIALS_NAME = "durable-credentials"  # the file's name in the sidecar's state dir on the box
MAX_CREDENTIALS = 64 << 10


@dataclass(frozen=True)
class Durable:
    url: str
    dir: Path | None  # the directory a file:// URL names; None for an object store

    @property
    def is_dir(self) -> bool:
        return self.dir is not None


def parse(url: str) -> Durable:
    """The durable URL `url`, checked; UsageError saying what to give instead."""
    if CONTROL.search(url):
        raise UsageError(f"durable URL {url!r} contains a control character; give the URL without it")
    u = urlsplit(url)
    if u.scheme == "file":
        if u.netloc not in ("", "localhost") or not u.path.startswith("/") or u.query or u.fragment:
            raise UsageError(f"durable URL {url!r}: give file:///absolute/dir")
        path = unquote(u.path)
        if CONTROL.search(path):  # a %00 or %0a decodes to one
            raise UsageError(f"durable URL {url!r} decodes to a path with a control character; remove it")
        return Durable(url, Path(path))
    if u.scheme == "s3":
        # No bucket name holds '@' or ':': a URL with either may carry a key and secret (which may
        # hold '/', so that the parser takes part of them for the path). Never echo it.
        if "@" in url or ":" in u.netloc:
            raise UsageError(
                "durable URL s3://…: credentials never go in the URL (status and the box's config show it; "
                "no bucket name holds '@' or ':'); give them with --durable-credentials FILE"
            )
        if not u.hostname or u.fragment:
            raise UsageError(f"durable URL {url!r}: give s3://BUCKET/PREFIX[?endpoint_url=URL&region=NAME]")
        names = [p for p in unquote(u.path).split("/") if p]
        if any(p in (".", "..") for p in names):
            raise UsageError(f"durable URL {url!r}: the prefix may not hold '.' or '..'")
        for key, value in parse_qsl(u.query, keep_blank_values=True):
            if key not in S3_OPTIONS:
                raise UsageError(
                    f"durable URL {url!r}: unknown option {key!r}; known: {', '.join(S3_OPTIONS)}"
                )
            if key == "proof" and value not in ("reread", "server-checksum"):
                raise UsageError(
                    f"durable URL {url!r}: proof must be reread (the default: every copy read back whole) "
                    "or server-checksum (the store's checksum only: cheaper, weaker)"
                )
            if key == "endpoint_url" and urlsplit(value).scheme not in ("http", "https"):
                raise UsageError(f"durable URL {url!r}: endpoint_url must be an http(s):// URL")
        return Durable(url, None)
    raise UsageError(
        f"durable URL {url!r}: supported are file:///absolute/dir and s3://BUCKET/PREFIX[?endpoint_url=…]"
    )


@dataclass(frozen=True)
class Bucket:
    """Where an s3:// store keeps a run's copies: the key of artifact P is `prefix + P`."""

    name: str
    prefix: str  # "" or ending in "/"
    endpoint_url: str | None
    region: str | None
    addressing_style: str


def corner(url: str, scope: tuple[str, ...]) -> Path | Bucket:
    """Where the copies of one run of a box lie in the store `url` (`scope`: the box's name and the
    run id, as the sidecar narrows its store): the directory `<dir>/<box>/<run id>` of a file://
    store, or the bucket and key prefix `<prefix>/<box>/<run id>/` of an s3:// one. The names are
    used raw: the sidecar quotes them only in the URL it shows (Hello.durable_root)."""
    d = parse(url)
    for part in scope:
        if not part or "/" in part or part in (".", ".."):
            raise UsageError(f"{part!r} cannot name a directory of the durable store")
    if d.dir is not None:
        return d.dir.joinpath(*scope)
    u = urlsplit(url)
    query = dict(parse_qsl(u.query, keep_blank_values=True))
    names = [p for p in unquote(u.path).split("/") if p]
    if query.get("addressing_style", "auto") not in ("path", "virtual", "auto"):
        raise UsageError(f"durable URL {url!r}: addressing_style must be path, virtual or auto")
    return Bucket(
        name=u.netloc,
        prefix="".join(f"{p}/" for p in [*names, *scope]),
        endpoint_url=query.get("endpoint_url") or None,
        region=query.get("region") or None,
        addressing_style=query.get("addressing_style") or "auto",
    )


def local_dir(url: str) -> Path | None:
    """The directory of a file:// URL; None for any other kind (or an empty or bad URL)."""
    try:
        return parse(url).dir if url else None
    except UsageError:
        return None


def read_credentials(path: Path) -> str:
    """The text of a credentials file for `up --durable-credentials`: a regular file only its owner
    may read. Its content is never shown; UsageError for anything else."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UsageError(f"--durable-credentials {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"--durable-credentials {path}: not a regular file")
    if st.st_mode & 0o077:
        raise UsageError(
            f"--durable-credentials {path}: other users can read or write it "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}` first"
        )
    if st.st_size > MAX_CREDENTIALS:
        raise UsageError(f"--durable-credentials {path}: {st.st_size} bytes is not a credentials file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(
            f"--durable-credentials {path}: cannot be read as text ({type(e).__name__})"
        ) from None
