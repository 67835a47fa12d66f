"""The one table from domain errors to HTTP statuses and gRPC codes, and the one bound on
the length of the message that goes with them. The error code (the third column) is the
client's: lastgood.errors.TABLE maps each to the class it raises (tests/unit/test_errors.py
checks that every code here has one)."""

from __future__ import annotations

import grpc

from lastgood.errors import CATALOG_BEHIND
from lastgood.fencing import FENCED

from ..domain import errors as e

TABLE: dict[type[e.DomainError], tuple[int, grpc.StatusCode, str]] = {
    e.NoCheckpoint: (404, grpc.StatusCode.NOT_FOUND, "no_checkpoint"),
    e.NoUsableCheckpoint: (409, grpc.StatusCode.FAILED_PRECONDITION, "no_usable_checkpoint"),
    e.NotFound: (404, grpc.StatusCode.NOT_FOUND, "not_found"),
    e.InvalidArgument: (400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"),
    e.Conflict: (409, grpc.StatusCode.ALREADY_EXISTS, "conflict"),
    e.Fenced: (409, grpc.StatusCode.FAILED_PRECONDITION, FENCED),
    e.SpoolRefused: (409, grpc.StatusCode.FAILED_PRECONDITION, "spool_refused"),
    e.SpoolNotShared: (409, grpc.StatusCode.FAILED_PRECONDITION, "spool_not_shared"),
    e.FollowRefused: (409, grpc.StatusCode.FAILED_PRECONDITION, "spool_follow_refused"),
    e.DirectOff: (409, grpc.StatusCode.FAILED_PRECONDITION, "direct_off"),
    e.FailedPrecondition: (409, grpc.StatusCode.FAILED_PRECONDITION, "failed_precondition"),
    e.HashMismatch: (422, grpc.StatusCode.DATA_LOSS, "hash_mismatch"),
    e.OutOfRange: (416, grpc.StatusCode.OUT_OF_RANGE, "out_of_range"),
    e.TooLarge: (413, grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large"),
    e.StreamsBusy: (429, grpc.StatusCode.RESOURCE_EXHAUSTED, "streams_busy"),
    e.Unauthenticated: (401, grpc.StatusCode.UNAUTHENTICATED, "unauthenticated"),
    e.PermissionDenied: (403, grpc.StatusCode.PERMISSION_DENIED, "permission_denied"),
    e.CatalogBehind: (503, grpc.StatusCode.UNAVAILABLE, CATALOG_BEHIND),
    e.Unavailable: (503, grpc.StatusCode.UNAVAILABLE, "unavailable"),
    e.StoreFull: (507, grpc.StatusCode.RESOURCE_EXHAUSTED, "store_full"),
}


def lookup(exc: e.DomainError) -> tuple[int, grpc.StatusCode, str]:
    for cls in type(exc).__mro__:
        if cls in TABLE:
            return TABLE[cls]
    return 400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument"


MAX_MESSAGE = 1024  # characters of an error message; the rest is counted, not sent


def bounded(message: str) -> str:
    """An error message cut to MAX_MESSAGE characters. Messages echo input (a vote's missing
    files, a bad header): unbounded, 20,000 file names outgrew gRPC's metadata limit and the
    client saw RESOURCE_EXHAUSTED instead of the real status."""
    if len(message) <= MAX_MESSAGE:
        return message
    return f"{message[:MAX_MESSAGE]}… ({len(message) - MAX_MESSAGE} more characters)"

