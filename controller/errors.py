"""The controller's error tree and exit codes. `cli/__init__.py` is the one place they become exits;
`client.py` is the one place gRPC errors become these.

    ControllerError (exit 1)
    ├── UsageError          bad arguments or names (exit 2)
    ├── StateError          controller state missing or unreadable (unknown box, no pulled tree)
    ├── SidecarUnreachable  the sidecar did not answer (socket gone, process dead, timeout)
    ├── SidecarRefused      the sidecar answered with an error status (code kept)
    ├── VersionMismatch     the sidecar runs another version than this controller
    ├── SidecarMismatch     the sidecar that answers is not the one the box's record names (exit 3)
    ├── TransferError       a pull failed (bytes did not hash equal, stream broke)
    │   └── Unavailable     one claim its source cannot give (no durable copy, or one of other bytes)
    └── GateRefused         verify failed or down is not allowed (exit 3); carries the reasons
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3


class ControllerError(Exception):
    exit_code = EXIT_ERROR


class UsageError(ControllerError):
    exit_code = EXIT_USAGE


class StateError(ControllerError):
    pass


class SidecarUnreachable(ControllerError):
    pass


class SidecarRefused(ControllerError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class VersionMismatch(ControllerError):
    pass


class SidecarMismatch(ControllerError):
    """An answer came from another sidecar than the box's (controller.identity): nothing it said is
    taken; the code is the gate's SIDECAR_MISMATCH."""

    exit_code = EXIT_REFUSED
    code = "SIDECAR_MISMATCH"


class TransferError(ControllerError):
    pass


class Unavailable(TransferError):
    """This claim cannot come from this source: the pull places the others, then fails naming it."""


@dataclass(frozen=True, slots=True)
class Reason:
    """One machine-readable reason the gate refused: a code from DESIGN §6, a path if it concerns one."""

    code: str
    path: str = ""
    detail: str = ""

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "path": self.path, "detail": self.detail}


class GateRefused(ControllerError):
    exit_code = EXIT_REFUSED

    def __init__(self, message: str, reasons: list[Reason]) -> None:
        super().__init__(message)
        self.reasons = reasons
