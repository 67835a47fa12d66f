"""Blob keys of checkpoints: the one place that spells them and reads them back.

    ckpt/<id>-<nonce>/r<rank>/<name>         a shard file (named by a one-way hash of its content hash)
    ckpt/<id>-<nonce>/manifest.json          the manifest that makes the checkpoint complete
    ckpt/<id>-<nonce>/r<rank>/<xxh3>.index   a safetensors file's tensor index, named in the manifest
    quarantine/ckpt/<id>-<nonce>/manifest.json   a manifest `rebuild` refused (unsealed by the
                                             service's keys, out of bounds, not matching its key), moved
                                             out of ckpt/ so nothing reads it as a checkpoint's again

Why a nonce next to the id: a catalog that loses its newest rows (a destroyed SQLite WAL, a
restored database backup) hands the same ids out again. Keyed by the id alone, a new
checkpoint would write into the lost one's folder, overwrite its manifest and let GC delete
its shards with its own. The nonce is derived from what identifies a save - run, step and
launch attempt - so it needs no column, is the same on every replica, and a checkpoint of
another catalog history with the same id gets another folder. It is derived from the
manifest's own fields too, so `rebuild` can check a manifest against its key.

Why a shard's name is not its xxh3-128: in `peer` verification another rank reads the file
back and reports the digest it got (domain/peer/verification_modes.py); a checker that could
read the declared digest off the key (a direct-FS path, a presigned GET's URL) could report it
without reading a byte. The name is the BLAKE2b-128 of the digest (`shard_name`): the same
content still gets the same key (a replicated file is stored once), and the digest cannot be
recovered from it.

Keys of older stores keep working: the catalog stores every key it wrote (shards.blob_key,
checkpoints.manifest_key) and reads use those; checkpoints written before the nonce
(`ckpt/<id>/...`) or with shards named by the digest itself (`legacy_shard_key`) are found by
`rebuild` under either name (`shard_keys`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import xxhash

ROOT = "ckpt/"
MANIFEST = "manifest.json"
INDEX_SUFFIX = ".index"
QUARANTINE = "quarantine/"
_KEY = re.compile(r"^ckpt/(\d+)(?:-([0-9a-f]{16}))?/(.+)$")


def nonce(run: str, step: int, attempt: str) -> str:
    return xxhash.xxh3_64_hexdigest(f"{run}\0{step}\0{attempt}".encode())


def prefix(checkpoint_id: int, run: str, step: int, attempt: str) -> str:
    return f"{ROOT}{checkpoint_id}-{nonce(run, step, attempt)}/"


def shard_name(xxh3: str) -> str:
    """A shard's object name: a one-way hash of its declared xxh3-128 (why: the module's doc)."""
    return hashlib.blake2b(bytes.fromhex(xxh3), digest_size=16, person=b"lastgood-shard").hexdigest()


def shard_key(ckpt_prefix: str, rank: int, xxh3: str) -> str:
    return f"{ckpt_prefix}r{rank}/{shard_name(xxh3)}"


def legacy_shard_key(ckpt_prefix: str, rank: int, xxh3: str) -> str:
    """Where stores written before `shard_name` keep a shard: named by its digest itself."""
    return f"{ckpt_prefix}r{rank}/{xxh3}"


def shard_keys(ckpt_prefix: str, rank: int, xxh3: str) -> tuple[str, str]:
    """Every key a shard of this digest may have in a store (rebuild looks for each)."""
    return shard_key(ckpt_prefix, rank, xxh3), legacy_shard_key(ckpt_prefix, rank, xxh3)


def index_key(ckpt_prefix: str, rank: int, index_xxh3: str) -> str:
    """A file's tensor index object (lastgood/wire/manifest.py): named by its hash, like a shard,
    so the root's reference (hash, size) is all a reader or a rebuild needs to find it."""
    return f"{ckpt_prefix}r{rank}/{index_xxh3}{INDEX_SUFFIX}"


def manifest_key(ckpt_prefix: str) -> str:
    return ckpt_prefix + MANIFEST


def quarantine_key(key: str) -> str:
    return QUARANTINE + key


@dataclass(frozen=True)
class ParsedKey:
    checkpoint_id: int
    nonce: str | None   # None: a key without one (its id alone names its checkpoint)
    rest: str           # "manifest.json" or "r<rank>/<xxh3>"

    @property
    def prefix(self) -> str:
        return f"{ROOT}{self.checkpoint_id}{'-' + self.nonce if self.nonce else ''}/"

    @property
    def is_manifest(self) -> bool:
        return self.rest == MANIFEST


def parse(key: str) -> ParsedKey | None:
    """A checkpoint blob's key taken apart, or None for a key lastgood did not write."""
    m = _KEY.match(key)
    return ParsedKey(int(m.group(1)), m.group(2), m.group(3)) if m else None


def belongs_to(parsed: ParsedKey, checkpoint_id: int, run: str, step: int, attempt: str) -> bool:
    """Whether a blob is this catalog row's: same id, and the nonce of its run, step and
    attempt (a key without a nonce belongs to the row with its id)."""
    return parsed.checkpoint_id == checkpoint_id and parsed.nonce in (None, nonce(run, step, attempt))
