"""Reads of committed checkpoints: a shard's bytes (streamed, ranged, or lent through the
spool), and the manifest, checked against its recorded hash on every read (I2)."""

from __future__ import annotations

from sqlalchemy import select

from lastgood.hashing import hash_bytes

from ...blobstore import capabilities
from ...catalog.models import COMMITTED, Shard
from ..errors import DamagedMismatch, DamagedMissing, FailedPrecondition, NotFound, OutOfRange
from .verification import CommitVerification


class CommitReads(CommitVerification):
    """A damaged manifest found by a read is marked CORRUPT at once, hence the base class."""

    def shard_for_read(self, checkpoint_id: int, rank: int, file_name: str) -> Shard:
        with self.sessions() as s, s.begin():
            ck = self._get_checkpoint(s, checkpoint_id)
            if ck.status != COMMITTED:
                raise FailedPrecondition(f"checkpoint {checkpoint_id} is {ck.status}; only committed checkpoints are readable")
            self._check_rank(ck, rank)
            sh = s.scalar(select(Shard).where(Shard.checkpoint_id == checkpoint_id, Shard.rank == rank,
                                              Shard.file_name == file_name))
            if sh is None:
                raise NotFound(f"checkpoint {checkpoint_id} rank {rank} has no file {file_name!r}")
            return sh

    def read_range(self, sh: Shard, offset: int, length: int | None):
        if offset < 0 or offset > sh.size or (length is not None and (length < 0 or offset + length > sh.size)):
            raise OutOfRange(f"range offset={offset} length={length} is outside the file's {sh.size} bytes")
        try:
            chunks = self.blobs.get(sh.blob_key, offset, length)
        except FileNotFoundError:
            raise NotFound(f"the blob of checkpoint {sh.checkpoint_id} rank {sh.rank} file {sh.file_name!r} is "
                           f"missing from the store; POST /api/v1/checkpoints/{sh.checkpoint_id}/verify "
                           f"marks the checkpoint CORRUPT") from None
        return chunks  # counted by the meter (blobstore/metered.py)

    def lend_shard(self, sh: Shard, spool) -> str | None:
        """The whole shard as a link in the spool for a reader on this host, or None."""
        path = capabilities.local_path(self.blobs, sh.blob_key)
        name = spool.lend(path) if path is not None else None
        if name is not None:  # served without a chunk through the meter
            self.metrics.bytes_served.inc(sh.size)
        return name

    def manifest_bytes(self, checkpoint_id: int) -> bytes:
        with self.sessions() as s, s.begin():
            ck = self._get_checkpoint(s, checkpoint_id)
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
