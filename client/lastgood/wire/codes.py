"""Error codes: the one table of what a refusal is called and how it travels.

Every refusal the service sends carries an error code: in the REST error body
(`{"error": {"code": ..., "message": ...}}`) and in the gRPC trailing metadata under
ERROR_METADATA. CODES gives each code its HTTP status and its gRPC status name; the
service's transports (lastgood_service.api.errors) send exactly these, and the client
(lastgood.errors) turns each code into one exception class. Neither side spells a status.

Fencing (docs/fencing.md): every launch of a job registers and gets its run's next
generation; once a newer generation has registered, the service refuses every write of an
older one with the code FENCED, so the client can tell "a newer launch owns this run"
(stop training) from any other refusal. The curation routes read the caller's generation
from GENERATION_HEADER.
"""

from __future__ import annotations

from typing import NamedTuple

# gRPC trailing metadata key holding a refusal's error code (the REST body's error.code)
ERROR_METADATA = "lastgood-error"
# the REST header that carries the caller's generation on the curation routes
GENERATION_HEADER = "Lastgood-Generation"

NOT_FOUND = "not_found"
NO_CHECKPOINT = "no_checkpoint"
INVALID_ARGUMENT = "invalid_argument"
INVALID_REQUEST = "invalid_request"
OUT_OF_RANGE = "out_of_range"
TOO_LARGE = "too_large"
CONFLICT = "conflict"
UNAUTHENTICATED = "unauthenticated"
PERMISSION_DENIED = "permission_denied"
FAILED_PRECONDITION = "failed_precondition"
FENCED = "fenced"
NO_USABLE_CHECKPOINT = "no_usable_checkpoint"
SPOOL_REFUSED = "spool_refused"
SPOOL_NOT_SHARED = "spool_not_shared"
SPOOL_FOLLOW_REFUSED = "spool_follow_refused"
DIRECT_OFF = "direct_off"
HASH_MISMATCH = "hash_mismatch"
UNAVAILABLE = "unavailable"
STREAMS_BUSY = "streams_busy"
RATE_LIMITED = "rate_limited"
INTERNAL = "internal"
CATALOG_BEHIND = "catalog_behind"
STORE_FULL = "store_full"
# the code of an HTTP error raised by the web framework itself (no route matched, a wrong
# method), not by a lastgood route
HTTP_ERROR = "http_error"


class Code(NamedTuple):
    """How one error code travels: its HTTP status and its gRPC status name."""
    http: int
    grpc: str


CODES: dict[str, Code] = {
    NOT_FOUND: Code(404, "NOT_FOUND"),
    NO_CHECKPOINT: Code(404, "NOT_FOUND"),
    INVALID_ARGUMENT: Code(400, "INVALID_ARGUMENT"),
    INVALID_REQUEST: Code(422, "INVALID_ARGUMENT"),  # a REST body that fails validation
    OUT_OF_RANGE: Code(416, "OUT_OF_RANGE"),
    TOO_LARGE: Code(413, "RESOURCE_EXHAUSTED"),
    CONFLICT: Code(409, "ALREADY_EXISTS"),
    UNAUTHENTICATED: Code(401, "UNAUTHENTICATED"),
    PERMISSION_DENIED: Code(403, "PERMISSION_DENIED"),
    FAILED_PRECONDITION: Code(409, "FAILED_PRECONDITION"),
    FENCED: Code(409, "FAILED_PRECONDITION"),
    NO_USABLE_CHECKPOINT: Code(409, "FAILED_PRECONDITION"),
    SPOOL_REFUSED: Code(409, "FAILED_PRECONDITION"),
    SPOOL_NOT_SHARED: Code(409, "FAILED_PRECONDITION"),
    SPOOL_FOLLOW_REFUSED: Code(409, "FAILED_PRECONDITION"),
    DIRECT_OFF: Code(409, "FAILED_PRECONDITION"),
    HASH_MISMATCH: Code(422, "DATA_LOSS"),
    UNAVAILABLE: Code(503, "UNAVAILABLE"),
    STREAMS_BUSY: Code(429, "RESOURCE_EXHAUSTED"),
    RATE_LIMITED: Code(429, "RESOURCE_EXHAUSTED"),
    INTERNAL: Code(500, "INTERNAL"),
    CATALOG_BEHIND: Code(503, "UNAVAILABLE"),
    STORE_FULL: Code(507, "RESOURCE_EXHAUSTED"),
}
