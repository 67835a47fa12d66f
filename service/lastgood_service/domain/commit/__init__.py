"""The commit of a checkpoint, one idea a module:

  core.py          what the parts share (catalog, store, clock, lease, the waiters' condition)
  protocol.py      begin, put, vote, commit (the invariants I1-I3 are kept there)
  votebatch.py     group commit of votes: the votes arriving together, one transaction
  lifecycle.py     abort, lease expiry, start-up recovery
  verification.py  re-hashing, and marking a checkpoint CORRUPT
  reads.py         shards and manifests of committed checkpoints

`CommitService` is all of them on one object, as the REST and gRPC layers use it.
"""

from __future__ import annotations

from .lifecycle import CommitLifecycle
from .reads import CommitReads


class CommitService(CommitLifecycle, CommitReads):
    pass
