"""The ONE place where errors become gRPC status codes: `translated` wraps every handler, unary and
streaming alike.

Domain errors map to specific codes; OSError maps by errno; anything unexpected is logged with its
traceback and answered INTERNAL with one line (never a bare UNKNOWN the controller cannot read).
UNAVAILABLE is never used for an error: the controller reads it as "the sidecar did not answer".
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

import grpc

from sidecar.errors import (
    ChangedError,
    ConfigError,
    NotFoundError,
    PreconditionError,
    SidecarError,
    StorageError,
    UnsafePathError,
)

logger = logging.getLogger(__name__)

STATUS: list[tuple[type[SidecarError], grpc.StatusCode]] = [
    (UnsafePathError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (PreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ChangedError, grpc.StatusCode.ABORTED),
    (StorageError, grpc.StatusCode.FAILED_PRECONDITION),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
]

OS_STATUS = {
    errno.ENOENT: grpc.StatusCode.NOT_FOUND,
    errno.EACCES: grpc.StatusCode.PERMISSION_DENIED,
    errno.EPERM: grpc.StatusCode.PERMISSION_DENIED,
    errno.ENOSPC: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errno.EDQUOT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errno.ENAMETOOLONG: grpc.StatusCode.INVALID_ARGUMENT,
}

F = TypeVar("F", bound=Callable[..., Any])


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(err, SidecarError):
        return next((c for t, c in STATUS if isinstance(err, t)), grpc.StatusCode.FAILED_PRECONDITION), str(
            err
        )
    if isinstance(err, OSError):
        code = OS_STATUS.get(err.errno or 0, grpc.StatusCode.FAILED_PRECONDITION)
        where = f" ({err.filename})" if err.filename else ""
        return code, f"I/O error on the box: {err.strerror or err}{where}"
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error in the sidecar: {type(err).__name__}: {err} (see its log)",
    )


async def _abort(context: Any, err: Exception, name: str) -> None:
    code, msg = status_of(err)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("%s failed unexpectedly", name, exc_info=err)
    await context.abort(code, msg)


def _is_abort(err: BaseException) -> bool:
    # context.abort() ends the call by raising; that exception must pass through untouched.
    return isinstance(err, grpc.aio.AbortError)


def translated(fn: F) -> F:
    """Wrap a servicer method (coroutine or async generator) so every error leaves as a status."""
    name = fn.__name__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except Exception as e:
                if _is_abort(e):
                    raise
                await _abort(context, e, name)

        return cast(F, stream)

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        try:
            return await fn(self, request, context)
        except Exception as e:
            if _is_abort(e):
                raise
            await _abort(context, e, name)

    return cast(F, unary)
