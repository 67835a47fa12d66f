"""Errors the client raises. Each says what went wrong in words an operator can act on."""

from __future__ import annotations


class LastgoodError(Exception):
    """Base class of every error lastgood raises on purpose."""


# The service's error code for a catalog that lacks commits its blob store holds: only an
# operator's `lastgood-service rebuild` ends it, so clients do not retry it (retry.py).
CATALOG_BEHIND = "catalog_behind"


class ServiceError(LastgoodError):
    """The service refused a request; `code` is the gRPC status name or HTTP status, `reason`
    the service's error code name when it sent one (`fenced`, `not_found`, ...)."""

    def __init__(self, message: str, code: str | int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


class SaveFailed(LastgoodError):
    """A background save did not commit; last-good did not move."""


class CorruptCheckpoint(LastgoodError):
    """Bytes read back do not match the hash recorded at commit."""


class NoUsableCheckpoint(LastgoodError):
    """The run committed checkpoints, but every one restore could fall back to is damaged
    (CORRUPT). A refusal, raised on every rank: restore never answers "no checkpoint" for
    such a run, which would start the training over."""


class FormatError(LastgoodError):
    """A shard file is not a valid lastgood safetensors file."""


class Fenced(LastgoodError):
    """A newer launch of this run has registered, so the service refuses this launch's
    writes and has abandoned its pending checkpoints. The process is a zombie of an
    earlier launch (its torchrun agent died, say): stop training, do not retry."""
