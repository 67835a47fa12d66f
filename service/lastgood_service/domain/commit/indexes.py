"""Tensor index objects: each safetensors file's index stored as a blob of its own.

Why: a manifest that held every rank's tensor index would make the commit parse and write
O(total tensors) and every restoring rank download all of it (docs/architecture.md,
"Checkpoint metadata"). So put_shard writes the file's index object as soon as the file
is verified (each rank's upload pays for its own index, in parallel), the catalog's
`shards.index_json` keeps only its reference {xxh3_128, size, tensors}, and the commit
copies references into the root: O(files), whatever the tensor count.

A row whose `index_json` holds the whole index (not a reference) has its object written
when the commit meets it, once.
"""

from __future__ import annotations

import json

from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import FileEntry, index_bytes, index_ref
from lastgood.wire.ranges import Blocks, fingerprint

from ...catalog.models import Shard
from .. import keys


def store(blobs, ckpt_prefix: str, rank: int, file_name: str, data_start: int, tensors: dict,
          digests: dict | None = None, chunks: dict | None = None, declared: bool = False) -> str:
    """Write one file's index object, with its range digests when given (lastgood/wire/ranges.py);
    what `shards.index_json` keeps of it: the reference, with the file's `chunks` when
    given (lastgood/wire/layout.py), which the commit copies into the root. `declared`: the
    digests are its writer's, for a peer to reproduce; the row also keeps their rule and
    fingerprint (DECLARED_RANGES), so that the peer check compares them without reading
    the index object back from the store (declared_ranges.of_shard)."""
    body = index_bytes(rank, file_name, data_start, tensors, digests)
    ref = index_ref(body, len(tensors), chunks)
    blobs.put_bytes(keys.index_key(ckpt_prefix, rank, ref["xxh3_128"]), body)
    if declared:
        ref[DECLARED_RANGES] = None if digests is None else {"rule": rule_of(digests), "fingerprint": fingerprint(digests)}
    return json.dumps(ref, sort_keys=True, separators=(",", ":"))


DECLARED_RANGES = "declared_ranges"  # the row's own note, never copied into the root (entry)


def rule_of(digests: dict) -> dict:
    """The block rule a peer recomputes the digests by: ranges.Blocks, which owns its keys."""
    return Blocks.read(digests).record()


def ref_of(sh: Shard) -> dict | None:
    """The shard's index reference; None for a file without one (not safetensors)."""
    if not sh.index_json:
        return None
    d = json.loads(sh.index_json)
    return d if "xxh3_128" in d else None


def key_of(ckpt_prefix: str, sh: Shard) -> str | None:
    ref = ref_of(sh)
    return keys.index_key(ckpt_prefix, sh.rank, ref["xxh3_128"]) if ref else None


def entry(blobs, ckpt_prefix: str, sh: Shard) -> FileEntry:
    """The shard's line in the root (a row holding its whole index has its object written here)."""
    ref = None
    if sh.index_json:
        d = json.loads(sh.index_json)
        d.pop(DECLARED_RANGES, None)
        ref = d if "xxh3_128" in d else json.loads(
            store(blobs, ckpt_prefix, sh.rank, sh.file_name, d["data_start"], d["tensors"]))
    return FileEntry(sh.file_name, sh.size, sh.xxh3_128, index=ref)


def found(store_, key: str) -> str:
    """The hash of the object at key, or "missing": what verify and fsck compare."""
    try:
        return hash_bytes(store_.read_all(key))
    except FileNotFoundError:
        return "missing"
