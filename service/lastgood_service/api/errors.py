"""The one table from domain errors to error codes, and the one bound on the length of the
message that goes with them. Each code's HTTP status and gRPC code are the wire's
(lastgood.wire.codes.CODES); the client maps each code to the class it raises."""

from __future__ import annotations

import grpc

from lastgood.wire import codes as c

from ..domain import errors as e

CODE_OF: dict[type[e.DomainError], str] = {
    e.NoCheckpoint: c.NO_CHECKPOINT,
    e.NoUsableCheckpoint: c.NO_USABLE_CHECKPOINT,
    e.NotFound: c.NOT_FOUND,
    e.InvalidArgument: c.INVALID_ARGUMENT,
    e.Conflict: c.CONFLICT,
    e.Fenced: c.FENCED,
    e.SpoolRefused: c.SPOOL_REFUSED,
    e.SpoolNotShared: c.SPOOL_NOT_SHARED,
    e.FollowRefused: c.SPOOL_FOLLOW_REFUSED,
    e.DirectOff: c.DIRECT_OFF,
    e.FailedPrecondition: c.FAILED_PRECONDITION,
    e.HashMismatch: c.HASH_MISMATCH,
    e.OutOfRange: c.OUT_OF_RANGE,
    e.TooLarge: c.TOO_LARGE,
    e.StreamsBusy: c.STREAMS_BUSY,
    e.RateLimited: c.RATE_LIMITED,
    e.Unauthenticated: c.UNAUTHENTICATED,
    e.PermissionDenied: c.PERMISSION_DENIED,
    e.CatalogBehind: c.CATALOG_BEHIND,
    e.Unavailable: c.UNAVAILABLE,
    e.StoreFull: c.STORE_FULL,
}


def travels(code: str) -> tuple[int, grpc.StatusCode, str]:
    """(HTTP status, gRPC code, code) of an error code, as the wire's table says."""
    http, grpc_name = c.CODES[code]
    return http, grpc.StatusCode[grpc_name], code


TABLE: dict[type[e.DomainError], tuple[int, grpc.StatusCode, str]] = {cls: travels(code) for cls, code in CODE_OF.items()}


def lookup(exc: e.DomainError) -> tuple[int, grpc.StatusCode, str]:
    for cls in type(exc).__mro__:
        if cls in TABLE:
            return TABLE[cls]
    return travels(c.INVALID_ARGUMENT)


MAX_MESSAGE = 1024  # characters of an error message; the rest is counted, not sent


def bounded(message: str) -> str:
    """An error message cut to MAX_MESSAGE characters. Messages echo input (a vote's missing
    files, a bad header): unbounded, 20,000 file names outgrow gRPC's metadata limit and the
    client would see RESOURCE_EXHAUSTED instead of the real status."""
    if len(message) <= MAX_MESSAGE:
        return message
    return f"{message[:MAX_MESSAGE]}… ({len(message) - MAX_MESSAGE} more characters)"

