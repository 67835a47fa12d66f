"""Range digests declared by a file's writer, for files the service does not read.

A direct upload to S3 (domain/dataplane/grants.py) and a direct-FS file in `peer` mode
(domain/peer/verification_modes.py) pass no byte through the service, so it cannot compute
their range digests as put_shard does for streamed files; without them a restore at
another world size reads such files whole (docs/resharding.md). Their writer computes them
instead, with the same rule (lastgood.wire.ranges.block_for) in the pass that hashes the
file for its upload, and declares them with the hand-over. Here they are checked for shape
(lastgood.wire.ranges.check_declared: the service's rule, the header's tensors and their
extents, the counts) and, cheaply, the header's digest against the header the service
reads anyway; then they go into the file's index object as if the service had computed
them, with the root's `chunks`.

Trust: they are as good as the file's declared xxh3-128 in the mode. `store`: the store
checked each part's CRC32 of the bytes the writer hashed in that same pass. `peer`: the
checking rank recomputes them from the stored bytes as it re-reads the file
(lastgood.wire.ranges.FileCheck), and a mismatch aborts the checkpoint as an xxh3-128 mismatch
does; so does the service's own read when no peer reported (domain/peer/peer_fallback.py).

Digests under another rule than the service's (it restarted with another
LASTGOOD_RANGE_BLOCK_BYTES since the writer asked) are dropped, not refused: the file is
then read whole at another world size, and the save goes on.
"""

from __future__ import annotations

import json
import logging

from lastgood.wire.errors import FormatError
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import FIXED_DIGESTS, RANGE_DIGESTS
from lastgood.wire.ranges import Blocks, check_declared, fingerprint

from ..errors import InvalidArgument
from . import indexes

log = logging.getLogger("lastgood")


def validate(cap: int, data_start: int, tensors: dict, header: bytes | memoryview, digests) -> dict | None:
    """The declared digests to write into the index object, or None (none declared, the
    service writes none, or another rule). InvalidArgument when their shape is wrong or
    the header's digest is not of the header: the hand-over is refused, nothing recorded."""
    if digests is None or not cap:
        return None
    rule = Blocks(cap).record()
    if isinstance(digests, dict) and {k: digests.get(k) for k in rule} != rule \
            and all(type(digests.get(k)) is int for k in rule):
        log.warning("declared range digests under the rule %s, not this service's %s: dropped (the file is "
                    "read whole at another world size)", {k: digests.get(k) for k in rule}, rule)
        return None
    try:
        out = check_declared(data_start, tensors, digests, cap)
    except FormatError as e:
        raise InvalidArgument(f"declared range digests refused: {e}") from None
    if out["header"] != hash_bytes(memoryview(header)[:data_start]):
        raise InvalidArgument("declared range digests refused: the header's digest is not the xxh3-128 of "
                              "the file's header")
    return out



def of_shard(store, ckpt_prefix: str, sh) -> dict | None:
    """{"rule", "fingerprint"} of the range digests a DECLARED file's writer declared (None:
    it declared none): what a peer's read of it must reproduce. From the catalog's row
    (indexes.store noted them at the hand-over), not the store: this runs for every file on
    every assignment poll and in the report, under the checkpoint's row lock. A row without
    the note has its index object read from the store."""
    ref = indexes.ref_of(sh)
    if ref is None:
        return None
    if indexes.DECLARED_RANGES in ref:
        return ref[indexes.DECLARED_RANGES]
    try:  # a row without the note: its index object holds the digests
        body = json.loads(b"".join(store.get(indexes.key_of(ckpt_prefix, sh))))
    except FileNotFoundError:
        return None
    digests = body.get(RANGE_DIGESTS, body.get(FIXED_DIGESTS))  # manifest.py: where an index keeps them
    return None if digests is None else {"rule": indexes.rule_of(digests), "fingerprint": fingerprint(digests)}


def rule_of(declared: dict | None) -> dict | None:
    """The block rule a peer recomputes the digests by (ranges.Blocks.record's keys)."""
    return None if declared is None else declared["rule"]


def fingerprint_of(declared: dict | None) -> str | None:
    """What the peer's `ranges_xxh3_128` must be (lastgood.wire.ranges.fingerprint)."""
    return None if declared is None else declared["fingerprint"]
