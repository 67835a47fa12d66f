"""Reads of committed checkpoints: a shard's bytes (streamed, ranged, or lent through the
spool), the manifest, checked against its recorded hash on every read (I2), and a file's
tensor index object, checked against the hash its manifest names (indexes.py)."""

from __future__ import annotations

import json

from sqlalchemy import select

from lastgood.wire import sealing
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import IndexMismatch, Manifest

from ...blobstore import capabilities
from ...catalog.models import COMMITTED, Shard
from ..errors import DamagedMismatch, DamagedMissing, FailedPrecondition, NotFound, OutOfRange, not_committed
from . import indexes
from .core import key_prefix
from . import tiering
from .verification import CommitVerification


class CommitReads(CommitVerification):
    """A damaged manifest found by a read is marked CORRUPT at once, hence the base class."""

    def shard_for_read(self, checkpoint_id: int, rank: int, file_name: str) -> Shard:
        with self.sessions() as s, s.begin():
            ck = self.get_checkpoint(s, checkpoint_id)
            if ck.status != COMMITTED:
                raise not_committed(checkpoint_id, ck.status, "read")
            tiering.refuse_blob(ck, "through the service")  # its bytes are in agents' memory
            self.check_rank(ck, rank)
            sh = s.scalar(select(Shard).where(Shard.checkpoint_id == checkpoint_id, Shard.rank == rank,
                                              Shard.file_name == file_name))
            if sh is None:
                raise NotFound(f"checkpoint {checkpoint_id} rank {rank} has no file {file_name!r}")
            return sh

    def read_range(self, sh: Shard, offset: int, length: int | None, check_only: bool = False):
        if offset < 0 or offset > sh.size or (length is not None and (length < 0 or offset + length > sh.size)):
            raise OutOfRange(f"range offset={offset} length={length} is outside the file's {sh.size} bytes")
        if check_only:  # a range lent through the spool: the bounds are all there is to check
            return None
        try:
            chunks = self.blobs.get(sh.blob_key, offset, length)
        except FileNotFoundError:
            raise NotFound(f"the blob of checkpoint {sh.checkpoint_id} rank {sh.rank} file {sh.file_name!r} is "
                           f"missing from the store; POST /api/v1/checkpoints/{sh.checkpoint_id}/verify "
                           f"marks the checkpoint CORRUPT") from None
        return chunks  # counted by the meter (blobstore/metered.py)

    def lend_shard(self, sh: Shard, spool, served: int | None = None) -> str | None:
        """The whole shard as a link in the spool for a reader on this host, or None;
        `served`: the bytes the reader takes from it (a range), counted as served."""
        path = capabilities.local_path(self.blobs, sh.blob_key)
        name = spool.lend(path) if path is not None else None
        if name is not None:  # served without a chunk through the meter
            self.metrics.bytes_served.inc(sh.size if served is None else served)
        return name

    def manifest_bytes(self, checkpoint_id: int) -> bytes:
        with self.sessions() as s, s.begin():
            ck = self.get_checkpoint(s, checkpoint_id)
            if ck.status != COMMITTED:
                raise FailedPrecondition(f"checkpoint {checkpoint_id} is {ck.status}; it has no visible manifest")
            key, want = ck.manifest_key, ck.manifest_hash
        try:
            body = self.blobs.read_all(key)
        except FileNotFoundError:
            self.mark_corrupt(checkpoint_id, [{"file": "manifest", "expected": want, "found": "missing"}])
            raise DamagedMissing(f"the manifest of checkpoint {checkpoint_id} is missing from the store; "
                                 f"the checkpoint is now CORRUPT") from None
        if hash_bytes(body) != want:
            self.mark_corrupt(checkpoint_id, [{"file": "manifest", "expected": want, "found": hash_bytes(body)}])
            raise DamagedMismatch(f"the manifest of checkpoint {checkpoint_id} does not match its hash; "
                                  f"the checkpoint is now CORRUPT")
        return body

    def index_bytes(self, checkpoint_id: int, rank: int, file_name: str) -> bytes:
        """One file's tensor index object, checked against the hash the manifest names
        (the catalog row holds the same reference; a rebuild restores it from the manifest).
        A missing or damaged one marks the checkpoint CORRUPT, like a damaged shard."""
        with self.sessions() as s, s.begin():
            sh = self.shard_for_read(checkpoint_id, rank, file_name)
            ref = indexes.ref_of(sh)
            if ref is None:
                raise NotFound(f"checkpoint {checkpoint_id} rank {rank} file {file_name!r} has no tensor index "
                               f"(not a safetensors file, or a manifest of format 1 that holds it inline)")
            key = indexes.key_of(key_prefix(s, self.get_checkpoint(s, checkpoint_id)), sh)
        what = {"rank": rank, "file": f"{file_name} (tensor index)", "expected": ref["xxh3_128"]}
        try:
            body = self.blobs.read_all(key)
        except FileNotFoundError:
            self.mark_corrupt(checkpoint_id, [{**what, "found": "missing"}])
            raise DamagedMissing(f"the tensor index of checkpoint {checkpoint_id} rank {rank} file {file_name!r} "
                                 f"is missing from the store; the checkpoint is now CORRUPT") from None
        if hash_bytes(body) != ref["xxh3_128"] or len(body) != ref["size"]:
            self.mark_corrupt(checkpoint_id, [{**what, "found": hash_bytes(body)}])
            raise DamagedMismatch(f"the tensor index of checkpoint {checkpoint_id} rank {rank} file {file_name!r} "
                                  f"does not match the hash its manifest names; the checkpoint is now CORRUPT")
        return body

    def full_manifest(self, checkpoint_id: int) -> dict:
        """The whole manifest with every file's tensors, for tools (the page, `lastgood show`):
        built on demand from the root and every index object, O(total tensors). Never on the
        restore path, which reads the root alone."""
        body = self.manifest_bytes(checkpoint_id)
        m = Manifest.from_bytes(body)
        try:
            view = m.with_indexes(lambda r, f: self.index_bytes(checkpoint_id, r, f.name)).to_dict()
            if (seal := json.loads(body).get(sealing.AUTH)) is not None:
                view[sealing.AUTH] = seal  # the stored root, seal included, plus every file's tensors
            return view
        except IndexMismatch as e:  # hash checked above: the content names another file
            self.mark_corrupt(checkpoint_id, [{"file": "tensor index", "expected": "this file's", "found": str(e)}])
            raise DamagedMismatch(f"checkpoint {checkpoint_id}: {e}; the checkpoint is now CORRUPT") from None
