"""The sidecar's error tree. `server.py` is the one place these become gRPC status codes.

SidecarError
├── ConfigError          bad or missing configuration (the daemon refuses to start)
├── UnsafePathError      a path from the wire or the disk that escapes its root    → INVALID_ARGUMENT
├── NotFoundError        no such claim / job                                       → NOT_FOUND
├── PreconditionError    the request is valid but the state forbids it            → FAILED_PRECONDITION
├── ChangedError         bytes on disk changed under us (claim or copy source)     → ABORTED
└── StorageError         the durable store failed (I/O, missing mount)             → UNAVAILABLE
"""

from __future__ import annotations


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose."""


class ConfigError(SidecarError):
    pass


class UnsafePathError(SidecarError):
    pass


class NotFoundError(SidecarError):
    pass


class PreconditionError(SidecarError):
    pass


class ChangedError(SidecarError):
    pass


class StorageError(SidecarError):
    """`reason` says what kind of failure it is (a PUSH_FAILED event leads with it): NO_SPACE,
    NO_INODES, QUOTA, PERMISSION, READ_ONLY, NOT_MOUNTED, IO_ERROR, NETWORK, THROTTLED, CREDENTIALS,
    SOURCE (the artifact itself could not be read), NOT_FOUND (no copy where one was asked for), or
    STORE_ERROR (anything else)."""

    def __init__(self, message: str, reason: str = "STORE_ERROR") -> None:
        super().__init__(message)
        self.reason = reason
