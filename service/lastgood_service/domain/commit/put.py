"""The put of a file: every data path's checks before it takes, grants or records a
file of a rank (check_header, admit_file), and put_shard, which streams a file into the
store, hashing it (or, handed over by name outside the `service` verification mode,
reading only its header) and records it. I1's half that is kept here: a blob is
published durably before its row says VERIFIED; I2's: a file is recorded only with the
size and hash it was declared with (protocol.py lists the invariants)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import replace

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from lastgood.wire import layout, names
from lastgood.wire.errors import FormatError
from lastgood.wire.format import header_length, parse_header, tensor_index
from lastgood.wire.ranges import RangeHasher
from lastgood.wire.hashing import StreamHasher, is_valid_hex

from ...catalog import txtimer
from ...catalog.models import DECLARED, VERIFIED, Checkpoint, Shard, Vote
from ...blobstore import capabilities
from ...blobstore.base import BlobWriter
from .. import keys
from ..runs import fencing
from ..errors import Conflict, FailedPrecondition, FollowRefused, HashMismatch, InvalidArgument, SpoolRefused, TooLarge
from ..events import add_event
from . import declared_ranges, indexes
from .core import CommitCore, key_prefix
from .types import PutResult, ShardHeader

log = logging.getLogger("lastgood.commit")


class _HashOnly(BlobWriter):
    """The writer of a followed file while it grows: the bytes are in the file already, and
    which blob it becomes is known only from its hash, at the end (put_shard)."""

    def write(self, data) -> None:
        pass

    def publish(self) -> None:
        raise AssertionError("a followed file is published by the writer that adopts it")

    def abort(self) -> None:
        pass


def read_header(prefix: bytearray, size: int, final: bool = False) -> tuple[int, dict, dict | None] | None:
    """A safetensors file's header from its first bytes `prefix` (of a file of `size` bytes):
    (data start, tensor index, where the file's DTensor shards lie: lastgood/wire/layout.py);
    None while the header is incomplete (`final`: the bytes are all there are, so an
    incomplete header is refused). InvalidArgument for a file that is not safetensors.
    Every path that records a file parses its header here (put_shard, direct uploads)."""
    try:
        if len(prefix) < 8:
            if final:
                raise FormatError("file shorter than a safetensors header")
            return None
        n = header_length(prefix)
        if len(prefix) < n:
            if final:
                raise FormatError("truncated safetensors header")
            return None
        tensors, meta = parse_header(memoryview(prefix)[:n], file_size=size)  # no copy of a copy
        chunks = layout.of_header(meta, tensors)  # in the guard: what it misses is the client's mistake
    except (FormatError, ValueError, TypeError, OverflowError) as e:
        raise InvalidArgument(f"not a valid safetensors file: {type(e).__name__}: {str(e)[:200]}") from None
    return n, tensor_index(tensors), chunks


class Declared:
    """Stands in for the hasher of put_shard when the service does not read the bytes (a
    file handed over by name outside the `service` verification mode, domain/peer/verification_modes.py):
    it counts the header bytes it is shown, and the rest of the file is vouched for by its
    size (the hand-over checked it with fstat) until a peer hashes it."""

    def __init__(self, size: int, xxh3_128: str) -> None:
        self.size, self._total, self._digest = 0, size, xxh3_128

    def update(self, data) -> None:
        self.size += len(data)

    def vouch(self) -> None:
        self.size = self._total

    def hexdigest(self) -> str:
        return self._digest


def header_chunks(fd: int, size: int, declared: Declared, want_header: bool, piece: int):
    """The safetensors header of the file behind `fd` (for its tensor index), in pieces of
    at most `piece` bytes; then the rest is vouched for (Declared.vouch)."""
    if want_header:
        head = os.pread(fd, min(8, size), 0)
        try:
            want = min(header_length(head), size)
        except FormatError:
            want = len(head)  # too short: the index parser says so
        pos = 0
        while pos < want:
            b = os.pread(fd, min(piece, want - pos), pos)
            if not b:
                break
            yield b
            pos += len(b)
    declared.vouch()


class CommitPut(CommitCore):
    """The put of a file (see the module's docstring)."""

    def check_header(self, header: ShardHeader, digest: bool = True) -> None:
        """What a file's header must be before anything is read or granted for it (every
        data path: the stream, the spool, direct uploads): the catalog open for writes, a
        valid name, a digest, a size within the limit. `digest=False`: the digest comes
        with the last byte (a followed hand-over) and is checked then."""
        self.gate.check()
        try:
            names.check_file_name(header.file_name)
        except names.InvalidName as e:
            raise InvalidArgument(str(e)) from None
        if digest and not is_valid_hex(header.xxh3_128):
            raise InvalidArgument("xxh3_128 must be 32 lowercase hex digits")
        if header.size < 0:
            raise InvalidArgument(f"size must be >= 0, got {header.size}")
        if header.size > self.settings.max_shard_bytes:
            raise TooLarge(f"shard of {header.size} bytes exceeds the limit of {self.settings.max_shard_bytes}")

    @txtimer.label("put")
    def put_shard(self, header: ShardHeader, chunks: Iterable[bytes], adopt=None, hashed: bool = True,
                  declared: dict | None = None, follow=None) -> PutResult:
        """Stream one shard file into a temporary blob, hashing as bytes arrive; publish it
        durably and record it VERIFIED only if size and hash match the client's.

        `adopt`: the chunks are read from this spooled shard (domain/dataplane/spool.Taken); a blob
        store that can make that very file the blob does so instead of copying it.
        `hashed=False` (an adopted direct-FS file outside the `service` verification mode,
        domain/peer/verification_modes.py): the file is published unread but for its header, and
        recorded DECLARED; the commit waits until a peer has checked it. `declared`: the
        range digests its writer declared for such a file (domain/commit/declared_ranges.py).
        `follow`: `chunks` come from a spooled file its writer is still writing
        (domain/dataplane/spool.Followed, `adopt` its Taken); the header has no hash, the writer's
        arrives with the last byte and is checked then, and the blob's key, which derives
        from it, is chosen then."""
        self.check_header(header, digest=follow is None)
        with self.sessions() as s, s.begin():
            if follow is not None and self._find_shard(s, header) is not None:  # a hash to compare with comes last
                raise SpoolRefused(f"spool: {header.file_name} of rank {header.rank} is recorded already; "
                                   f"stream it to compare")
            ck, present = self.admit_file(s, header, "upload")
            if present is not None:
                return present
            if ck.lease_expires_at < self.lease_from_now() - self._lease_slack():  # fresh: a put storm writes nothing here
                ck.lease_expires_at = self.lease_from_now()
            # The key derives from the declared hash, so an S3 multipart upload can start now;
            # bytes that do not match it are aborted and never become visible. (A followed
            # file's hash comes with its last byte: its key is chosen then, below.)
            pfx = key_prefix(s, ck)
            key = keys.shard_key(pfx, header.rank, header.xxh3_128) if follow is None else None

        hasher = StreamHasher()
        index_json = None
        segments = None  # the range digests, from the moment the header is parsed
        want_index = header.file_name.endswith(".safetensors")
        prefix = bytearray()
        renew_every = self.settings.lease_seconds / 4
        last_renew = time.monotonic()
        if adopt is None or follow is not None:  # bytes still to be written on the store's disk
            self._require_room(header.size)
        if follow is not None:
            writer = _HashOnly()  # the file is hashed as it grows; adopted once its hash names the key
        else:
            writer = capabilities.adopt_writer(self.blobs, key, adopt) if adopt is not None else None
        if not hashed and writer is None:
            raise SpoolRefused("spool: this hand-over cannot be renamed into the store; stream the shard")
        if not hashed:  # domain/peer/verification_modes.py: a peer checks the bytes; only the header is read here
            hasher = Declared(header.size, header.xxh3_128)
            chunks = header_chunks(adopt.fd, header.size, hasher, want_index,
                                                      self.settings.max_chunk_bytes)
        with writer or self.blobs.open_writer(key) as w:
            for chunk in chunks:
                if len(chunk) > self.settings.max_chunk_bytes:
                    raise InvalidArgument(f"chunk of {len(chunk)} bytes exceeds {self.settings.max_chunk_bytes}")
                if hasher.size + len(chunk) > header.size:
                    raise InvalidArgument(f"stream is longer than the declared {header.size} bytes")
                hasher.update(chunk)
                w.write(chunk)
                if want_index and index_json is None:
                    prefix += chunk
                    index_json = read_header(prefix, header.size)
                    if index_json is not None:
                        if not hashed:  # declared_ranges.py: checked against this header, before publish
                            declared = declared_ranges.validate(self.settings.range_block_bytes, *index_json[:2],
                                                                prefix, declared)
                        segments = self._segments(index_json, prefix)
                        prefix = bytearray()
                elif segments is not None:
                    segments.update(chunk)
                if time.monotonic() - last_renew > renew_every:
                    self.renew(header.checkpoint_id)
                    last_renew = time.monotonic()
            if hasher.size != header.size:
                raise InvalidArgument(f"stream ended after {hasher.size} of the declared {header.size} bytes")
            if want_index and index_json is None:
                index_json = read_header(prefix, header.size, final=True)
                if not hashed:
                    declared = declared_ranges.validate(self.settings.range_block_bytes, *index_json[:2], prefix,
                                                        declared)
                segments = self._segments(index_json, prefix)
            digest = hasher.hexdigest()
            if follow is not None:  # the writer's hash, sent after its last byte
                if not is_valid_hex(follow.digest):
                    raise InvalidArgument("xxh3_128 must be 32 lowercase hex digits")
                header = replace(header, xxh3_128=follow.digest)
            if digest != header.xxh3_128:
                self.record_mismatch(header, digest)
                raise HashMismatch(f"xxh3-128 of the received bytes is {digest}, the client declared "
                                   f"{header.xxh3_128}: shard rejected")
            if follow is None:
                w.publish()
            else:  # the key derives from the hash: the file is adopted now, under it
                key = keys.shard_key(pfx, header.rank, header.xxh3_128)
                adopted = capabilities.adopt_writer(self.blobs, key, adopt)
                if adopted is None:  # the client hands its files over once written from then on (those are copied)
                    raise FollowRefused("spool: a file handed over while it is written cannot be renamed into "
                                        "this store; stream the shard")
                with adopted:
                    adopted.publish()
        digests = segments.digests() if segments is not None and hashed else None
        if not hashed:  # the service read only the header: the writer's digests, checked above (or none)
            digests = declared
        if index_json is not None:  # the file's tensor index, as an object of its own (indexes.py)
            index_json = indexes.store(self.blobs, pfx, header.rank, header.file_name, *index_json[:2], digests,
                                       # where its shards lie, in the root: only with digests (layout.py)
                                       chunks=index_json[2] if digests is not None else None,
                                       declared=not hashed)  # a peer reproduces them (declared_ranges.of_shard)

        with self.sessions() as s:
            try:
                with s.begin():
                    ck = self.get_checkpoint(s, header.checkpoint_id, lock=True)  # serialises with votes
                    fencing.check(s, ck.run_id, ck.generation, f"upload to checkpoint {ck.id}", writes_checkpoints=True)
                    self.require_pending(ck, "record the shard")
                    self._require_not_voted(s, header)
                    s.add(Shard(checkpoint_id=ck.id, rank=header.rank, file_name=header.file_name,
                                size=header.size, xxh3_128=digest, blob_key=key,
                                status=VERIFIED if hashed else DECLARED,
                                index_json=index_json, created_at=self.clock()))
                    # a recorded file is rank activity: a whole lease from here (settings.lease_seconds),
                    # not only when stale as at admission, which a hand-over reaches a moment before
                    ck.lease_expires_at = self.lease_from_now()
            except IntegrityError:  # the same file arrived twice at once
                with s.begin():
                    return self.answer_recorded(s, header)
        return PutResult(False, header.size, digest)

    def admit_file(self, s: Session, h: ShardHeader, what: str, *,
                   lock: bool = False) -> tuple[Checkpoint, PutResult | None]:
        """The checks every data path makes before it takes, grants or records one file of a
        rank (put_shard; direct uploads' grant, hand-over and record, domain/dataplane/grants.py), in
        one place so the paths cannot drift apart: the checkpoint exists, the rank is one of
        it, its launch is not fenced; a file recorded already is answered as it is (the
        same bytes: already present; other bytes: Conflict); else the checkpoint must be
        PENDING and the rank must not have voted. Returns the checkpoint and, for a file
        recorded already, the answer. `lock`: take the checkpoint's row lock (serialises
        with votes). `what` names the operation in the errors."""
        ck = self.get_checkpoint(s, h.checkpoint_id, lock=lock)
        self.check_rank(ck, h.rank)
        fencing.check(s, ck.run_id, ck.generation, f"{what} to checkpoint {ck.id}", writes_checkpoints=True)
        existing = self._find_shard(s, h)
        if existing is not None:
            return ck, self._same_or_conflict(existing, h)
        self.require_pending(ck, what)
        self._require_not_voted(s, h)
        return ck, None

    def answer_recorded(self, s: Session, h: ShardHeader) -> PutResult:
        """The answer to a file that is recorded already (a second hand-over of it that lost
        the race to record it): the same bytes, already present; other bytes, Conflict."""
        return self._same_or_conflict(self._find_shard(s, h), h)

    @staticmethod
    def _require_not_voted(s: Session, h: ShardHeader) -> None:
        if s.get(Vote, (h.checkpoint_id, h.rank)) is not None:
            raise FailedPrecondition(f"rank {h.rank} already voted on checkpoint {h.checkpoint_id}; "
                                     f"its vote named all its files, so {h.file_name!r} cannot be added")

    @staticmethod
    def _find_shard(s: Session, h: ShardHeader) -> Shard | None:
        return s.scalar(select(Shard).where(Shard.checkpoint_id == h.checkpoint_id, Shard.rank == h.rank,
                                            Shard.file_name == h.file_name))

    @staticmethod
    def _same_or_conflict(existing: Shard, h: ShardHeader) -> PutResult:
        if existing.size == h.size and existing.xxh3_128 == h.xxh3_128:
            return PutResult(True, existing.size, existing.xxh3_128)
        raise Conflict(f"rank {h.rank} already uploaded {h.file_name!r} to checkpoint {h.checkpoint_id} "
                       f"with different bytes ({existing.size} bytes, xxh3 {existing.xxh3_128})")

    def _segments(self, index: tuple[int, dict], prefix: bytearray) -> RangeHasher | None:
        """The file's range digests (lastgood/wire/ranges.py), fed from here on; the bytes so far
        are `prefix`. None when range_block_bytes is 0."""
        if not self.settings.range_block_bytes:
            return None
        hasher = RangeHasher(*index[:2], self.settings.range_block_bytes)
        hasher.update(prefix)
        return hasher

    def record_mismatch(self, h: ShardHeader, digest: str) -> None:
        """A file whose bytes are not the hash its writer declared: logged, counted, and a
        hash_mismatch event recorded (whoever found it: put_shard, a peer's read-back)."""
        log.warning("hash mismatch on checkpoint %s rank %s file %s", h.checkpoint_id, h.rank, h.file_name,
                    extra={"checkpoint_id": h.checkpoint_id, "rank": h.rank})
        self.metrics.hash_mismatches.inc()
        with self.sessions() as s, s.begin():
            ck = s.get(Checkpoint, h.checkpoint_id)
            add_event(s, "hash_mismatch", ck.run_id if ck else None, h.checkpoint_id, rank=h.rank,
                      file=h.file_name, declared=h.xxh3_128, received=digest)
