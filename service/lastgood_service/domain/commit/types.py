"""What the commit's calls take and answer: plain values, shared by every part of the
commit (domain/commit/__init__.py) and by the data paths and transports that call it."""

from __future__ import annotations

from dataclasses import dataclass

from lastgood.wire.manifest import Manifest


@dataclass(frozen=True)
class ShardHeader:
    checkpoint_id: int
    rank: int
    file_name: str
    size: int
    xxh3_128: str


@dataclass(frozen=True)
class PutResult:
    already_present: bool
    size: int
    xxh3_128: str


@dataclass(frozen=True)
class CommitPlan:
    """What a commit writes, read while the checkpoint was PENDING with every file verified."""
    manifest: Manifest
    key: str       # the manifest's blob key
    run_id: int
    last_vote: object  # datetime of the last vote (the commit_seconds metric)


@dataclass(frozen=True)
class VoteResult:
    checkpoint_id: int
    status: str
    missing_ranks: list[int]
