"""The vocabularies both sides speak: a checkpoint's status, a shard's, who verifies a
handed-over file, and a rank's phase in its heartbeats. Each is a str enum, so a member is
the very string that travels (`Status.COMMITTED == "COMMITTED"`) and JSON writes it so."""

from __future__ import annotations

import enum


class _Word(str, enum.Enum):
    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class Status(_Word):
    """A checkpoint's status (the catalog's `checkpoints.status`, `Checkpoint.status` on the wire)."""
    PENDING = "PENDING"
    COMMITTED = "COMMITTED"
    ABANDONED = "ABANDONED"
    CORRUPT = "CORRUPT"
    DELETED = "DELETED"


class ShardStatus(_Word):
    """A shard's: hashed by whoever verifies (VERIFIED), or handed over unhashed until a
    peer checks it (DECLARED)."""
    VERIFIED = "VERIFIED"
    DECLARED = "DECLARED"


class Verification(_Word):
    """Who reads a handed-over file's bytes before the commit (LASTGOOD_VERIFICATION,
    `GET /api/v1/info` verification; docs/dataplane.md)."""
    SERVICE = "service"
    PEER = "peer"
    STORE = "store"


class Phase(_Word):
    """What a rank is doing, as its heartbeats say."""
    TRAIN = "train"
    SAVING = "saving"
    RESTORING = "restoring"
    IDLE = "idle"
