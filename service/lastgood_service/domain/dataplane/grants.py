"""Direct uploads to an S3 store: the service grants, the store carries the bytes, the
service decides (docs/direct-s3.md).

Why: through the service every byte of every shard crosses one Python process. Here a rank
asks for a *grant* for one file of its own on a PENDING checkpoint; the service starts a
multipart upload of that file's key and answers presigned UploadPart URLs, one a part, each
signing the part's CRC32 the rank computed (blobstore/s3direct.py). The rank uploads the
parts in parallel straight to the store, which refuses a part whose bytes do not match its
CRC32 (BadDigest). At the *hand-over* the rank names what it uploaded (upload id, part
numbers, ETags, CRC32s); the service confirms every part from the store's own listing
(ListParts: sizes, ETags and the CRC32 the store computed), completes the upload, checks
the object's size (HEAD), and records the file DECLARED (below). No byte of the
file passes through the service, but the safetensors header (a ranged GET of the first
bytes), which its tensor index object needs. A mismatch refuses the hand-over: the rank
cannot vote with that file, and the checkpoint never commits.

What a grant can touch: one key, `ckpt/<id>-<nonce>/r<rank>/<name>` (domain/keys.py), of a checkpoint the
caller's token may write (api/auth.py checks the route's checkpoint), for one upload, for
`direct_s3_grant_seconds`. The signature covers key, upload id, part number and CRC32:
another key, another upload or a late request is refused by the store.

Nothing is orphaned: an abort or a lease expiry aborts the checkpoint's open uploads
(`end`, which main.py makes one of the commit service's end listeners), and every GC pass
sweeps the open uploads of checkpoints that are no longer PENDING (domain/gc/ calls `sweep`),
the backstop for a service that died between.

Verification (domain/peer/verification_modes.py): the store verifies each part's CRC32 as it
takes it, which ties the stored bytes to the CRC32s the rank computed, not to the xxh3-128 it
declared beside them (no S3 store computes xxh3; a rank that hashed other bytes than it
uploaded would otherwise commit them). So the file is recorded DECLARED in both modes, and
its xxh3-128 is checked against the stored object before the checkpoint may commit: in
`store` mode by the service, which reads the object back on a thread of its own from the
hand-over on (`commits.confirm`: domain/peer/peer_fallback.py); in `peer` mode by another
rank through a presigned GET (or the service, after the grace). Then a CRC32 the store does not report (moto keeps none)
refuses nothing: the read-back checks the bytes; one it reports that disagrees still does.
The restoring client checks the xxh3-128 end to end in either mode.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import logging
from dataclasses import dataclass

from minio.error import S3Error
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from lastgood.wire.info import DirectS3Offer
from lastgood.wire.s3parts import CHECKSUM_HEADER, MAX_PARTS, part_layout  # one rule, both sides
from lastgood.wire.errors import FormatError
from lastgood.wire.format import header_length

from ...blobstore import capabilities
from ...blobstore.s3direct import StoredPart, composite
from ...catalog.models import DECLARED, PENDING, Checkpoint, Run, Shard
from ...failpoints import Failpoint, reach
from .. import keys
from ..commit import declared_ranges, indexes
from ..commit.core import key_prefix
from ..commit.put import read_header
from ..commit.types import PutResult, ShardHeader
from ..errors import Conflict, DirectOff, FailedPrecondition, HashMismatch, InvalidArgument
from ..events import add_event
from ..peer import verification_modes

log = logging.getLogger("lastgood.grants")

def _check_crc(value: str, where: str) -> str:
    try:
        ok = len(base64.b64decode(value, validate=True)) == 4
    except (binascii.Error, ValueError, TypeError):
        ok = False
    if not ok:
        raise InvalidArgument(f"{where}: a CRC32 is 4 bytes in base64 (8 characters), got {str(value)[:20]!r}")
    return value


@dataclass(frozen=True)
class UploadedPart:
    number: int
    etag: str
    crc32: str


class DirectUploads:
    def __init__(self, commits) -> None:
        """`commits`: the CommitService (its catalog, store, settings and helpers)."""
        self.commits = commits
        self.settings = commits.settings

    @property
    def store_verifies(self) -> bool:
        """`store` mode: the store's part checksums are the verification; else (`peer`) a
        rank's read-back is, and the file is recorded DECLARED until it is done."""
        return verification_modes.store_verifies(self.settings.verification)

    def _crc_agrees(self, reported: str | None, want: str) -> bool:
        """Does the CRC32 the store reports (of a part, or a completed object's composite
        `...-n`) vouch for `want`? In `store` mode it must be reported and equal. In `peer`
        mode one the store does not report in that form (none, or not composite: moto)
        refuses nothing, the peer's read-back checks the bytes; a reported one that
        disagrees still refuses."""
        if reported == want:
            return True
        if reported is None:
            comparable = False
        elif "-" in want:  # a composite: comparable when the store reports one of as many parts
            comparable = reported.endswith("-" + want.rpartition("-")[2])
        else:
            comparable = True
        return not self.store_verifies and not comparable

    def _direct(self):
        d = capabilities.direct(self.commits.store, self.settings.s3_public_endpoint) \
            if self.settings.direct_s3 else None
        if d is None:
            raise DirectOff("direct uploads are off: they need an s3:// blob store and "
                            "LASTGOOD_DIRECT_S3=true; stream the file instead")
        return d

    def info(self) -> DirectS3Offer | None:
        """What GET /api/v1/info says of direct uploads (None: off)."""
        if not self.settings.direct_s3 or not isinstance(self.commits.store, capabilities.GrantsDirectAccess):
            return None
        return DirectS3Offer(part_size=self.settings.direct_s3_part_size, max_parts=MAX_PARTS, checksum="crc32",
                             grant_seconds=self.settings.direct_s3_grant_seconds)

    # ------------------------------------------------------------ grant
    def _file(self, h: ShardHeader, *, for_what: str):
        """Check the file's header and the checkpoint (CommitService.admit_file: put_shard's
        checks); its key, and the stored shard if the file is recorded already."""
        c = self.commits
        c.check_header(h)
        with c.sessions() as s, s.begin():
            ck, present = c.admit_file(s, h, for_what)
            if present is not None:
                return None, present, None
            ck.lease_expires_at = c.lease_from_now()
            pfx = key_prefix(s, ck)
            return keys.shard_key(pfx, h.rank, h.xxh3_128), None, pfx

    def grant(self, h: ShardHeader, crc32s: list[str], part_size: int | None = None) -> dict:
        """Start the file's multipart upload; one presigned UploadPart URL a part, each
        signing that part's CRC32. A file recorded already needs no grant. `part_size`:
        the one the rank checksummed with (any within S3's bounds; the route checks them),
        so a rank that learned the terms before the setting changed is not refused."""
        d = self._direct()
        part_size, n = part_layout(h.size, part_size or self.settings.direct_s3_part_size)
        if len(crc32s) != n:
            raise InvalidArgument(f"a file of {h.size} bytes has {n} parts of {part_size} bytes; "
                                  f"{len(crc32s)} CRC32s were given")
        for i, crc in enumerate(crc32s):
            _check_crc(crc, f"part {i + 1}")
        key, present, pfx = self._file(h, for_what="grant an upload")
        if present is None and self._shared(d, h, key, crc32s):
            present = self._record(h, key, self._index(key, h, pfx))
        if present is not None:
            return {"already_present": True, "part_size": part_size, "parts": []}
        upload_id = d.create_upload(key)
        expires = self.settings.direct_s3_grant_seconds
        parts = [{"number": i + 1, "url": d.presign_part(key, upload_id, i + 1, crc, expires), "crc32": crc}
                 for i, crc in enumerate(crc32s)]
        return {"already_present": False, "upload_id": upload_id, "part_size": part_size, "expires_in": expires,
                "checksum_header": CHECKSUM_HEADER, "parts": parts}

    # ------------------------------------------------------------ hand-over
    def hand_over(self, h: ShardHeader, upload_id: str, uploaded: list[UploadedPart],
                  part_size: int | None = None, digests: dict | None = None) -> PutResult:
        """Confirm the upload from the store's metadata, complete it, record the file (DECLARED:
        the service, or a peer, reads it back). `digests`: the range digests its writer declared
        (domain/commit/declared_ranges.py)."""
        d = self._direct()
        if not upload_id or len(upload_id) > 1024:
            raise InvalidArgument("upload_id must be 1..1024 characters")
        for p in uploaded:
            _check_crc(p.crc32, f"part {p.number}")
        key, present, pfx = self._file(h, for_what="record the upload")
        if present is not None:
            return present
        part_size, n = part_layout(h.size, part_size or self.settings.direct_s3_part_size)
        mine = sorted(uploaded, key=lambda p: p.number)
        try:
            shared = self._shared(d, h, key, [p.crc32 for p in mine])
        except Conflict:
            d.abort_upload(key, upload_id)
            raise
        if shared:  # granted before the other file was recorded: never completed over it
            d.abort_upload(key, upload_id)
            return self._record(h, key, self._index(key, h, pfx))
        try:
            stored = d.list_parts(key, upload_id)
        except S3Error as e:
            if e.code != "NoSuchUpload":
                raise
            stored = None
        if stored is None:  # completed by an earlier hand-over that did not get to record it?
            self._completed_before(d, h, key, upload_id, n, uploaded)
        else:
            problem = self._compare(h, n, part_size, stored, uploaded)
            if problem:
                self._refuse(d, h, key, upload_id, problem)
            d.complete(key, upload_id, stored)
            reach(Failpoint.CRASH_AFTER_DIRECT_COMPLETE, self.settings.failpoint, self.settings.data_dir)
        info = self.commits.store.stat(key)
        if info is None or info.size != h.size:
            self.commits.store.delete(key)  # a whole object of other bytes: never left under the file's key
            self._refuse(d, h, key, upload_id, f"the completed object has {info.size if info else 'no'} bytes, "
                                               f"not {h.size}")
        for other_key, other in d.uploads(key):  # a retried grant's upload of the same file
            if other_key == key and other != upload_id:
                d.abort_upload(key, other)
        if digests is not None:
            # testing only: another file records this key meanwhile
            reach(Failpoint.HOLD_DECLARED_INDEX, self.settings.failpoint, self.settings.data_dir)
        try:
            index_json = self._index(key, h, pfx, digests)
        except InvalidArgument:  # not a safetensors file, or declared digests refused: nothing of it is kept
            self._drop_unless_recorded(h, key)
            raise
        return self._record(h, key, index_json)

    def _drop_unless_recorded(self, h: ShardHeader, key: str) -> None:
        """Delete the refused file's object, unless a recorded file lies on it: another file
        of the rank with the same bytes (the key is their xxh3-128), recorded since `_shared`
        looked. Checked under the checkpoint's row lock, which recording a file takes."""
        with self.commits.sessions() as s, s.begin():
            s.get(Checkpoint, h.checkpoint_id, with_for_update=True)
            if s.scalar(select(Shard.id).where(Shard.checkpoint_id == h.checkpoint_id,
                                               Shard.blob_key == key).limit(1)) is None:
                self.commits.store.delete(key)

    def _shared(self, d, h: ShardHeader, key: str, crc32s: list[str]) -> bool:
        """Whether another file of the checkpoint is recorded under this key already (the
        same rank, the same claimed xxh3-128) with the same bytes: then this file is recorded
        on that object, with no upload. A completion under the key would overwrite that
        file's object, so other bytes (another size, another composite CRC32 of the parts)
        are refused."""
        with self.commits.sessions() as s:
            other = s.execute(select(Shard.file_name, Shard.size).where(
                Shard.checkpoint_id == h.checkpoint_id, Shard.blob_key == key,
                Shard.file_name != h.file_name).limit(1)).first()
        if other is None:
            return False
        found = d.completed(key)
        if other.size == h.size and found is not None and found[0] == h.size \
                and self._crc_agrees(found[2], composite([], crc32s)[1]):
            return True
        raise Conflict(f"rank {h.rank}'s {other.file_name!r} of checkpoint {h.checkpoint_id} is stored under the "
                       f"xxh3-128 {h.xxh3_128} that {h.file_name!r} claims, with other bytes: refused, so that "
                       f"its object is not overwritten")

    def _completed_before(self, d, h: ShardHeader, key: str, upload_id: str, n: int,
                          uploaded: list[UploadedPart]) -> None:
        """A hand-over whose upload is gone: a retry after the service completed it and then
        failed (a restart, a 5xx, the client's timeout) must still record the file, so the
        object at the key is confirmed from what the store reports of it, without reading a
        byte: its size, and its composite ETag and CRC32 against the parts the rank names
        (the first hand-over confirmed those parts from the store's listing)."""
        gone = FailedPrecondition(f"no upload {upload_id!r} of rank {h.rank}'s {h.file_name!r} is open, and no "
                                  f"completed object of it is stored (aborted, or never granted for this file)")
        found = d.completed(key)
        if found is None:
            raise gone
        size, etag, crc = found
        mine = sorted(uploaded, key=lambda p: p.number)
        if [p.number for p in mine] != list(range(1, n + 1)):
            self._refuse(d, h, key, upload_id, f"the hand-over names parts {[p.number for p in mine][:20]}, "
                                               f"a file of {h.size} bytes has 1..{n}")
        want_etag, want_crc = composite([p.etag for p in mine], [p.crc32 for p in mine])
        if crc is None and self.store_verifies:
            problem = "the store reports no CRC32 of the completed object, so it cannot vouch for its bytes"
        elif size != h.size:
            problem = f"the completed object has {size} bytes, not {h.size}"
        elif not self._crc_agrees(crc, want_crc) or (etag.endswith(f"-{n}") and etag != want_etag):
            problem = (f"the completed object (ETag {etag}, CRC32 {crc}) is not the parts the hand-over names "
                       f"(ETag {want_etag}, CRC32 {want_crc})")
        else:
            return
        self._refuse(d, h, key, upload_id, problem)  # the object stays: it may be another hand-over's

    def _compare(self, h: ShardHeader, n: int, part_size: int, stored: list[StoredPart],
                 uploaded: list[UploadedPart]) -> str | None:
        """What is wrong with the upload, from the store's listing; None when it is whole."""
        numbers = [p.number for p in stored]
        if numbers != list(range(1, n + 1)):
            return f"the store holds parts {numbers[:20]}, a file of {h.size} bytes needs 1..{n}"
        if sorted(p.number for p in uploaded) != numbers:
            return f"the hand-over names parts {sorted(p.number for p in uploaded)[:20]}, the store holds 1..{n}"
        mine = {p.number: p for p in uploaded}
        for p in stored:
            want = part_size if p.number < n else h.size - part_size * (n - 1)
            if p.size != want:
                return f"part {p.number} has {p.size} bytes in the store, {want} expected"
            if p.etag != mine[p.number].etag.strip('"'):
                return f"part {p.number}'s ETag in the store is {p.etag}, the rank uploaded {mine[p.number].etag}"
            if p.crc32 is None and self.store_verifies:
                return (f"the store reports no CRC32 for part {p.number}: it does not keep (or check) part "
                        f"checksums, so it cannot vouch for the bytes; use a store that does, or `peer` verification")
            if not self._crc_agrees(p.crc32, mine[p.number].crc32):
                return f"part {p.number}'s CRC32 in the store is {p.crc32}, the rank computed {mine[p.number].crc32}"
        return None

    def _refuse(self, d, h: ShardHeader, key: str, upload_id: str, problem: str):
        log.warning("direct upload refused: checkpoint %s rank %s file %s: %s", h.checkpoint_id, h.rank,
                    h.file_name, problem, extra={"checkpoint_id": h.checkpoint_id, "rank": h.rank})
        self.commits.metrics.hash_mismatches.inc()
        try:
            d.abort_upload(key, upload_id)
        except Exception:  # noqa: BLE001 - the checkpoint's end or GC aborts it again
            log.exception("aborting upload %s of %s failed", upload_id, key)
        with self.commits.sessions() as s, s.begin():
            ck = s.get(Checkpoint, h.checkpoint_id)
            add_event(s, "direct_upload_refused", ck.run_id if ck else None, h.checkpoint_id, rank=h.rank,
                      file=h.file_name, reason=problem[:500])
        raise HashMismatch(f"direct upload of rank {h.rank}'s {h.file_name!r} refused: {problem}")

    def _index(self, key: str, h: ShardHeader, pfx: str, digests: dict | None = None) -> str | None:
        """The tensor index object of a safetensors file, from its header alone (ranged reads),
        with the range digests its writer declared, checked for shape (domain/commit/declared_ranges.py)."""
        if not h.file_name.endswith(".safetensors"):
            return None
        store = self.commits.store
        head = b"".join(store.get(key, 0, min(8, h.size)))
        try:
            n = header_length(head)
        except FormatError as e:
            raise InvalidArgument(f"not a valid safetensors file: {e}") from None
        if n > 8:
            head += b"".join(store.get(key, 8, min(n, h.size) - 8))
        data_start, tensors, chunks = read_header(bytearray(head), h.size, final=True)
        digests = declared_ranges.validate(self.settings.range_block_bytes, data_start, tensors, head, digests)
        return indexes.store(self.commits.blobs, pfx, h.rank, h.file_name, data_start, tensors, digests,
                             chunks=chunks if digests is not None else None,  # as put_shard: only with digests
                             declared=True)  # a peer (DECLARED) and verify reproduce them

    def _record(self, h: ShardHeader, key: str, index_json: str | None) -> PutResult:
        c = self.commits
        with c.sessions() as s:
            try:
                with s.begin():
                    ck, present = c.admit_file(s, h, "record the shard", lock=True)  # serialises with votes
                    if present is not None:
                        return present
                    # DECLARED in both modes: the store verified the parts' CRC32s, which say nothing
                    # of the xxh3-128 the rank declared beside them (the store computes no xxh3);
                    # `peer`: a rank reads it back; `store`: the service does, now (below)
                    s.add(Shard(checkpoint_id=ck.id, rank=h.rank, file_name=h.file_name, size=h.size,
                                xxh3_128=h.xxh3_128, blob_key=key, index_json=index_json, created_at=c.clock(),
                                status=DECLARED))
                    ck.lease_expires_at = c.lease_from_now()
                    add_event(s, "direct_upload", ck.run_id, ck.id, rank=h.rank, file=h.file_name, bytes=h.size)
            except IntegrityError:  # two hand-overs of the same file at once, as put_shard
                with s.begin():
                    return c.answer_recorded(s, h)
        if self.store_verifies and c.confirm is not None:
            # the declared xxh3-128 confirmed against the stored object before the checkpoint may
            # commit: read from the store on a thread of the service's, while the other ranks
            # upload and vote (peer_fallback: a match verifies it and commits once all voted;
            # a mismatch aborts the checkpoint). Unset (no fallback), the sweep does it after the grace
            c.confirm(h.checkpoint_id, [(h.rank, h.file_name)], "store mode: the store checked the parts' CRC32s, "
                                                                "the service checks the declared xxh3-128")
        return PutResult(False, h.size, h.xxh3_128)

    # ------------------------------------------------------------ reads
    def read_url(self, checkpoint_id: int, rank: int, file_name: str) -> dict:
        """A presigned GET of a committed checkpoint's file (the reader re-hashes it)."""
        d = self._direct()
        sh = self.commits.shard_for_read(checkpoint_id, rank, file_name)  # the one rule of what is readable
        key, size, digest = sh.blob_key, sh.size, sh.xxh3_128
        expires = self.settings.direct_s3_grant_seconds
        return {"url": d.presign_get(key, expires), "size": size, "xxh3_128": digest, "expires_in": expires}

    # ------------------------------------------------------------ nothing orphaned
    def end(self, checkpoint_ids: list[int]) -> int:
        """Abort the open uploads of checkpoints that ended (aborted, expired). Never raises:
        GC's sweep is the backstop."""
        d = capabilities.direct(self.commits.store)
        if d is None or not checkpoint_ids:
            return 0
        n = 0
        try:
            with self.commits.sessions() as s, s.begin():
                prefixes = [key_prefix(s, ck) for ck in s.scalars(
                    select(Checkpoint).where(Checkpoint.id.in_(checkpoint_ids)))]
            for pfx in prefixes:
                for key, upload_id in d.uploads(pfx):
                    d.abort_upload(key, upload_id)
                    n += 1
        except Exception:  # noqa: BLE001
            log.exception("aborting the uploads of checkpoints %s failed; GC sweeps them", checkpoint_ids)
        return n


def sweep(sessions, store, now: dt.datetime, grant_seconds: float) -> int:
    """Abort every open upload under ckpt/ whose checkpoint is no longer PENDING: GC's
    backstop (domain/gc/) for an abort or expiry whose own `end` did not get through. An upload
    of a checkpoint this catalog has no row for (the row purged, the catalog rebuilt or
    restored) is aborted once it is older than a grant lives (`grant_seconds`): nobody can
    upload to it or hand it over any more. Never raises: a store that cannot list uploads
    must not stop GC's deletions."""
    d = capabilities.direct(store)
    if d is None:
        return 0
    n = 0
    try:
        open_ = [(keys.parse(k), k, u, t) for k, u, t in d.uploads_since(keys.ROOT)]
        ids = sorted({p.checkpoint_id for p, _, _, _ in open_ if p})
        with sessions() as s, s.begin():
            q = (select(Checkpoint.id, Checkpoint.status, Run.name, Checkpoint.step, Checkpoint.attempt)
                 .join(Run, Run.id == Checkpoint.run_id).where(Checkpoint.id.in_(ids)))
            rows = {r[0]: r[1:] for r in s.execute(q).all()} if ids else {}
        for p, key, upload_id, began in open_:
            if p is None:  # a key lastgood did not write is left alone, as GC leaves such blobs
                continue
            row = rows.get(p.checkpoint_id)
            if row is not None and keys.belongs_to(p, p.checkpoint_id, *row[1:]):
                if row[0] == PENDING:
                    continue
            elif began is None or (now - began.replace(tzinfo=began.tzinfo or dt.timezone.utc)
                                   ).total_seconds() <= grant_seconds:
                continue  # no row of ours: aborted only once no grant of it can be alive
            d.abort_upload(key, upload_id)
            n += 1
    except Exception:  # noqa: BLE001
        log.exception("sweeping open multipart uploads failed; the next GC pass tries again")
    if n:
        log.info("aborted %d multipart uploads of checkpoints that are no longer pending", n)
    return n
