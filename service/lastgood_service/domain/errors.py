"""Domain errors. Transports map each class to one HTTP status and one gRPC code (api/errors.py)."""

from __future__ import annotations


class DomainError(Exception):
    """A request the service refuses; the message is shown to the caller as it is."""


class NotFound(DomainError):
    pass


class InvalidArgument(DomainError):
    pass


class Conflict(DomainError):
    """The request contradicts what is already recorded (different bytes, world size, vote)."""


class FailedPrecondition(DomainError):
    """The request is valid but the checkpoint is not in a state that allows it."""


# why a checkpoint of each status other than COMMITTED cannot be read, tagged or leased
_NOT_COMMITTED = {
    "PENDING": "its save is still in progress",
    "ABANDONED": "its save never completed (not every rank's shard arrived before it was abandoned)",
    "CORRUPT": "a verification found bytes that do not match its manifest",
    "DELETED": "GC deleted its files",
}


def not_committed(checkpoint_id: int, status: str, use: str, allowed: str = "COMMITTED") -> FailedPrecondition:
    """The refusal of a read, tag or lease of a checkpoint that is not COMMITTED: its status,
    what that means, and which checkpoints can be `use`d ('read', 'tagged', 'leased')."""
    why = _NOT_COMMITTED.get(status)
    return FailedPrecondition(f"checkpoint {checkpoint_id} is {status}" + (f": {why}" if why else "")
                              + f"; only {allowed} checkpoints can be {use}")


class Fenced(FailedPrecondition):
    """A write from a launch older than the run's newest registered one (domain/runs/fencing.py)."""


class SpoolRefused(FailedPrecondition):
    """A spooled hand-over this service cannot take (the file is gone, or another user's):
    the client streams the shard instead (domain/dataplane/spool.py)."""


class SpoolNotShared(SpoolRefused):
    """The header names a spool this service does not read (another host or data directory,
    or it takes none): the client streams from now on."""


class FollowRefused(SpoolRefused):
    """A followed hand-over (domain/dataplane/spool.Followed) this store cannot adopt: the client
    streams the shard, and hands its files over once written from then on."""


class DirectOff(FailedPrecondition):
    """A grant or read grant of a direct upload asked of a service that offers none (any
    more): the client refreshes the service's info and streams instead (domain/dataplane/grants.py)."""


class HashMismatch(DomainError):
    pass


class OutOfRange(DomainError):
    pass


class TooLarge(DomainError):
    pass


class StreamsBusy(DomainError):
    """Too many streams are open (api/streams.py); nothing was read: the client retries."""


class RateLimited(DomainError):
    """Too many of these requests lately (a run's launch registrations); later ones pass."""


class Unauthenticated(DomainError):
    """No credentials, or credentials that are malformed, unknown or revoked."""


class PermissionDenied(DomainError):
    """Valid credentials that do not allow this operation or this run."""


class StoreFull(DomainError):
    """The store has no room for this (the message says how much it has)."""


class Unavailable(DomainError):
    """The service cannot do this now (a clear reason says until when); clients retry."""


class CatalogBehind(Unavailable):
    """The catalog lacks commits the store holds (domain/gate.py): writes wait for `rebuild`."""


class NoCheckpoint(NotFound):
    """The run exists but never committed a checkpoint: a job starts from scratch."""


class NoUsableCheckpoint(FailedPrecondition):
    """The run committed checkpoints, but none is usable any more (all damaged): a refusal,
    never to be read as "no checkpoint", which would start the training over."""


class Damaged(DomainError):
    """Stored bytes of a committed checkpoint are gone or differ from what was committed.
    Raised once the checkpoint has been marked CORRUPT and last-good has moved back."""


class DamagedMissing(NotFound, Damaged):
    pass


class DamagedMismatch(HashMismatch, Damaged):
    pass
