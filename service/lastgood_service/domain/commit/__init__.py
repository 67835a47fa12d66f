"""The commit of a checkpoint, one idea a module:

  types.py            the values its calls take and answer (ShardHeader, PutResult, VoteResult, ...)
  core.py             what the parts share (catalog, store, clock, lease, the waiters' condition)
  put.py              the put of a file, and the checks every data path makes before it
  protocol.py         begin, vote, commit (the invariants I1-I3, and where each is kept)
  votebatch.py        group commit of votes: the votes arriving together, one transaction
  lifecycle.py        abort, lease expiry, start-up recovery
  verification.py     re-hashing, and marking a checkpoint CORRUPT
  reads.py            shards and manifests of committed checkpoints
  indexes.py          each file's tensor index, an object of its own in the store
  declared_ranges.py  range digests a file's writer declared, for files the service does not read
  outcomes.py         how waiting ranks learn a checkpoint's outcome (one notifier per process)

`CommitService` is the parts from core.py to reads.py on one object, as the REST and gRPC
layers use it.
"""

from __future__ import annotations

from .lifecycle import CommitLifecycle
from .reads import CommitReads


class CommitService(CommitLifecycle, CommitReads):
    pass
