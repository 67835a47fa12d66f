"""Errors the client raises, and the one table that turns the service's answers into them.

Each says what went wrong in words an operator can act on. torch-free and grpc-free: the
command line imports it for every command.

Every refusal the service sends carries an error code (lastgood.wire.codes): in the
REST error body (`{"error": {"code": ..., "message": ...}}`) and in the gRPC trailing
metadata under ERROR_METADATA. TABLE below maps each code to one class (its HTTP status
and gRPC code are the wire's); `from_http` and `from_grpc` are the only places an
answer becomes an error, so callers match on classes (`except NotFound`), never on a
status, a gRPC code name or the message. An answer without a code we know (a proxy's 502,
an older or newer service) is classified by its HTTP status or gRPC code instead.

    ServiceError                 reason, status (HTTP), grpc_code, detail, retryable
    ├── Unavailable              retried: the same request may succeed later
    │   ├── ServiceUnreachable   no answer at all (refused, reset, timed out)
    │   ├── Busy                 too many streams open; nothing was read
    │   ├── RateLimited          too many of these requests lately (a run's launches); later ones pass
    │   └── Internal             the request failed inside the service (HTTP 500)
    ├── Refused                  the service said no; sending it again will not help
    │   ├── NotFound ── NoCheckpoint
    │   ├── InvalidArgument, OutOfRange, TooLarge, Conflict
    │   ├── Unauthenticated, PermissionDenied
    │   └── FailedPrecondition ── Fenced, NoUsableCheckpoint, DirectOff, SpoolRefused ── SpoolNotShared, FollowRefused
    ├── DataLoss                 the service's stored bytes differ from the commit
    ├── CatalogBehind, StoreFull an operator has to act (rebuild, free space): not retried
    └── GaveUp                   the client stopped retrying (a newer save wants the buffer)
"""

from __future__ import annotations

import json

from lastgood.wire import codes as c
from lastgood.wire.codes import ERROR_METADATA
from lastgood.wire.errors import FormatError, LastgoodError  # noqa: F401 - FormatError is raised as lastgood.errors.FormatError

class SaveFailed(LastgoodError):
    """A background save did not commit; last-good did not move."""


class CorruptCheckpoint(LastgoodError):
    """Bytes read back do not match the hash recorded at commit."""


class DDPInternalsChanged(LastgoodError):
    """This torch's DistributedDataParallel lacks an internal that keeping its gradient-bucket
    layout across a resume relies on, or builds its Reducer otherwise (state/ddp_buckets.py)."""


class ServiceError(LastgoodError):
    """The service refused or failed a request, or did not answer.

    `reason`: the service's error code (`not_found`, `fenced`, ...; the class's own when the
    answer carried none). `status`: the HTTP status (REST), `grpc_code`: the gRPC status
    name (gRPC). `code` is whichever of the two applies (match on the class
    instead). `detail`: the service's message without the method and path.
    `retryable`: would the same request, sent again later, plausibly succeed? `coded`: the
    answer carried an error code this client knows, i.e. a lastgood route said it (not a
    proxy, not the web framework)."""

    reason: str | None = None
    transient = False

    def __init__(self, message: str, code: str | int | None = None, reason: str | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.coded = reason in TABLE
        self.reason = reason or type(self).reason
        self.status = code if isinstance(code, int) else None
        self.grpc_code = code if isinstance(code, str) else None
        self.detail = message if detail is None else detail

    @property
    def retryable(self) -> bool:
        kind = type(self)
        if kind is ServiceError and self.code is not None:  # made by hand from a bare status or code
            kind = _classify(self.status, self.grpc_code, self.reason)
        return kind.transient

    @property
    def no_route(self) -> bool:
        """The answer came from the web framework, not from a lastgood route: the URL is not
        a lastgood service, or one too old to know the route."""
        return self.reason == c.HTTP_ERROR


class Unavailable(ServiceError):
    """The service cannot answer now (restarting, overloaded, a proxy without a backend):
    the same request may succeed later, so the retry policy retries it."""
    reason = c.UNAVAILABLE
    transient = True


class ServiceUnreachable(Unavailable):
    """No answer from the service: refused, unresolvable, reset, or timed out."""
    reason = None


class Busy(Unavailable):
    """The service refused a stream because too many are open; it read nothing."""
    reason = c.STREAMS_BUSY


class RateLimited(Unavailable):
    """The service takes only so many of these requests per time (registrations of a run's
    launches: docs/security.md); the message says the bound. Retried: once the window has
    moved on, the same request passes, so a job that relaunches in a tight loop waits."""
    reason = c.RATE_LIMITED


class Internal(Unavailable):
    """The request failed inside the service (its log says why). Retried like an outage;
    the command line reports it as an unexpected error."""
    reason = c.INTERNAL


class Refused(ServiceError):
    """The service refused the request; sending it again unchanged will not help."""


class NotFound(Refused):
    """No such run, checkpoint, file, tag, lease or token."""
    reason = c.NOT_FOUND


class NoCheckpoint(NotFound):
    """The run exists but never committed a checkpoint."""
    reason = c.NO_CHECKPOINT


class InvalidArgument(Refused):
    reason = c.INVALID_ARGUMENT


class OutOfRange(Refused):
    reason = c.OUT_OF_RANGE


class TooLarge(Refused):
    reason = c.TOO_LARGE


class Conflict(Refused):
    """The request contradicts what is recorded (other bytes for a stored shard, another
    world size for a begun checkpoint)."""
    reason = c.CONFLICT


class Unauthenticated(Refused):
    """No token, or one the service does not know (or has revoked)."""
    reason = c.UNAUTHENTICATED


class PermissionDenied(Refused):
    """A valid token that does not allow this operation or this run."""
    reason = c.PERMISSION_DENIED


class FailedPrecondition(Refused):
    """A valid request, but the checkpoint or run is not in a state that allows it (no
    longer pending, not committed, ...)."""
    reason = c.FAILED_PRECONDITION


class Fenced(FailedPrecondition):
    """A newer launch of this run has registered, so the service refuses this launch's
    writes and has abandoned its pending checkpoints. The process is a zombie of an
    earlier launch (its torchrun agent died, say): stop training, do not retry."""
    reason = c.FENCED


class NoUsableCheckpoint(FailedPrecondition):
    """The run committed checkpoints, but every one restore could fall back to is damaged
    (CORRUPT). A refusal, raised on every rank: restore never answers "no checkpoint" for
    such a run, which would start the training over."""
    reason = c.NO_USABLE_CHECKPOINT


class SpoolRefused(FailedPrecondition):
    """The service did not take a shard handed over through the spool (the file was taken
    already or swept, or another user's): the client streams that shard instead."""
    reason = c.SPOOL_REFUSED


class SpoolNotShared(SpoolRefused):
    """The service does not read the spool the client wrote to (another host or data
    directory, or it takes no spooled files): the client streams from now on."""
    reason = c.SPOOL_NOT_SHARED


class FollowRefused(SpoolRefused):
    """The service cannot take a file while it is written (a followed hand-over: its store
    cannot adopt the spool's files): the client streams that shard, and hands its files
    over once written from then on."""
    reason = c.SPOOL_FOLLOW_REFUSED


class DirectOff(FailedPrecondition):
    """The service does not (or no longer) offer direct uploads to its store: the client
    refreshes the service's info and sends that file, and later ones, through the service."""
    reason = c.DIRECT_OFF


class DataLoss(ServiceError):
    """The service's stored bytes are gone or differ from what was committed (it has marked
    the checkpoint CORRUPT and moved last-good back)."""
    reason = c.HASH_MISMATCH


class CatalogBehind(ServiceError):
    """The catalog lacks commits its blob store holds: only an operator's
    `lastgood-service rebuild` ends it, so it is not retried (HTTP 503 nonetheless)."""
    reason = c.CATALOG_BEHIND


class StoreFull(ServiceError):
    """The service's store has no room: an operator frees space or grows the volume."""
    reason = c.STORE_FULL


class GaveUp(ServiceError):
    """A call stopped retrying before its deadline because the caller no longer needs it
    (a newer save is waiting). `last` is the transient failure it was retrying."""

    def __init__(self, message: str, last: BaseException) -> None:
        super().__init__(message, getattr(last, "code", None), getattr(last, "reason", None))
        self.last = last


# Each error code (lastgood.wire.codes) -> the class raised for it. tests/unit/test_errors.py
# checks that every code of the wire has one, so a code added there cannot be forgotten here.
TABLE: dict[str, type[ServiceError]] = {
    c.NOT_FOUND: NotFound, c.NO_CHECKPOINT: NoCheckpoint, c.INVALID_ARGUMENT: InvalidArgument,
    c.INVALID_REQUEST: InvalidArgument, c.OUT_OF_RANGE: OutOfRange, c.TOO_LARGE: TooLarge, c.CONFLICT: Conflict,
    c.UNAUTHENTICATED: Unauthenticated, c.PERMISSION_DENIED: PermissionDenied,
    c.FAILED_PRECONDITION: FailedPrecondition, c.FENCED: Fenced, c.NO_USABLE_CHECKPOINT: NoUsableCheckpoint,
    c.SPOOL_REFUSED: SpoolRefused, c.SPOOL_NOT_SHARED: SpoolNotShared, c.SPOOL_FOLLOW_REFUSED: FollowRefused,
    c.DIRECT_OFF: DirectOff, c.HASH_MISMATCH: DataLoss, c.UNAVAILABLE: Unavailable, c.STREAMS_BUSY: Busy,
    c.RATE_LIMITED: RateLimited,
    c.INTERNAL: Internal, c.CATALOG_BEHIND: CatalogBehind, c.STORE_FULL: StoreFull,
}

# An answer whose code is missing or unknown, by HTTP status ...
BY_STATUS: dict[int, type[ServiceError]] = {
    400: InvalidArgument, 401: Unauthenticated, 403: PermissionDenied, 404: NotFound, 409: Conflict,
    413: TooLarge, 416: OutOfRange, 422: InvalidArgument, 429: Busy, 500: Internal,
    502: Unavailable, 503: Unavailable, 504: Unavailable, 507: StoreFull,
}
# 5xx that say so for good: not implemented, HTTP version not supported
PERMANENT_5XX = frozenset({501, 505})

# ... or by gRPC status name. INTERNAL, UNKNOWN and CANCELLED stay plain ServiceErrors (not
# retried): gRPC raises them for the client's own failures too (a request iterator that
# failed), so they say nothing about the service.
BY_GRPC: dict[str, type[ServiceError]] = {
    "NOT_FOUND": NotFound, "INVALID_ARGUMENT": InvalidArgument, "OUT_OF_RANGE": OutOfRange,
    "RESOURCE_EXHAUSTED": TooLarge, "ALREADY_EXISTS": Conflict, "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied, "FAILED_PRECONDITION": FailedPrecondition, "DATA_LOSS": DataLoss,
    "UNAVAILABLE": Unavailable, "DEADLINE_EXCEEDED": Unavailable,
}


def _classify(status: int | None, grpc_code: str | None, reason: str | None) -> type[ServiceError]:
    if reason in TABLE:
        return TABLE[reason]
    if status is not None:
        if status in BY_STATUS:
            return BY_STATUS[status]
        if 500 <= status <= 599 and status not in PERMANENT_5XX:
            return Internal
        return ServiceError
    return BY_GRPC.get(grpc_code or "", ServiceError)


def from_http(method: str, path: str, status: int, body: bytes) -> ServiceError:
    """The error an HTTP error answer means: the class of its error code, else of its status."""
    reason = None
    try:
        err = json.loads(body)["error"]
        detail, reason = str(err["message"]), err.get("code")
    except Exception:  # noqa: BLE001 - not our JSON error body: a proxy's page, say
        detail = body[:500].decode(errors="replace")
    reason = reason if isinstance(reason, str) else None
    cls = _classify(status, None, reason)
    return cls(f"{method} {path}: HTTP {status}: {detail}", status, reason, detail)


def from_grpc(what: str, code: str, details: str, trailing) -> ServiceError:
    """The error a failed gRPC call means: the class of the error code in its trailing
    metadata, else of its status name (`code`, e.g. "NOT_FOUND")."""
    reason = dict(trailing or ()).get(ERROR_METADATA)
    reason = reason if isinstance(reason, str) else None
    cls = _classify(None, code, reason)
    return cls(f"{what}: {code}: {details}", code, reason, details)
