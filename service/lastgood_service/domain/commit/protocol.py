"""The two-phase commit protocol: begin, put, vote, commit.

Invariants (docs/architecture.md), and where this module keeps them:
  I1 no acknowledged commit is lost: a rank hears COMMITTED only after the one transaction
     that marks the checkpoint COMMITTED and moves last-good has committed; blobs were
     published durably (fsync + rename + fsync dir) before they were recorded VERIFIED.
  I2 nothing is visible unless complete: a checkpoint becomes COMMITTED only when every
     rank voted with exactly its verified files (each vote checked where it is written,
     votebatch.py, and all of them again by try_commit; reads.py serves COMMITTED
     checkpoints only; verification.py re-hashes and marks CORRUPT).
  I3 last-good moves forward only in the commit transaction (domain/last_good.py, advance);
     a failed save never touches it.
Commit is exactly-once under races: the status change is a conditional UPDATE
(`WHERE status = 'PENDING'`), so of two committers, or a committer and the lease reaper
(lifecycle.py), exactly one wins. No database work happens per chunk.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import replace

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from lastgood.wire import layout, names
from lastgood.wire.errors import FormatError
from lastgood.wire.format import header_length, parse_header, tensor_index
from lastgood.wire.ranges import RangeHasher
from lastgood.wire.hashing import StreamHasher, hash_bytes, is_valid_hex
from lastgood.wire.manifest import FileEntry, Manifest

from ...catalog import txtimer
from ...catalog.models import (ABANDONED, COMMITTED, CORRUPT, DECLARED, PENDING, VERIFIED, Checkpoint, Run, Shard,
                               Vote)
from ...blobstore import capabilities
from ...blobstore.base import BlobWriter
from .. import declared_ranges, fencing, keys, last_good, verification_modes
from .. import branches  # stored branches (catalog)
from ..errors import (Conflict, FailedPrecondition, Fenced, FollowRefused, HashMismatch, InvalidArgument, NotFound,
                      SpoolRefused, StoreFull, TooLarge)
from ..events import add_event
from . import indexes
from .core import CommitCore, key_prefix
from .types import CommitPlan, PutResult, ShardHeader, VoteResult

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
    (data start, tensor index, where the file's DTensor shards lie: lastgood/layout.py);
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


class CommitProtocol(CommitCore):
    def _require_room(self, size: int) -> None:
        """Refuse a shard the store cannot hold before a byte of it is written, keeping
        `store_reserve_bytes` free for the catalog and for GC's own writes (0: unknown size)."""
        free = capabilities.free_bytes(self.blobs) if size else None
        if free is not None and size > free - self.settings.store_reserve_bytes:
            raise StoreFull(f"store full: {free} bytes free, a shard of {size} bytes does not fit beside the "
                            f"{self.settings.store_reserve_bytes}-byte reserve; free space (GC, retention) "
                            f"or grow the volume")

    def _failpoint(self, name: str) -> None:
        """Crash the process here when the (testing-only) failpoint setting names this point;
        a hold_* point instead blocks until the file <data_dir>/<name>.release exists (a test
        holds a commit right there, to see what other calls do meanwhile)."""
        if self.settings.failpoint == name and name.startswith("hold_"):
            log.warning("failpoint %s: holding until %s.release exists", name, name)
            while not (self.settings.data_dir / f"{name}.release").exists():
                time.sleep(0.05)
        elif self.settings.failpoint == name:
            log.critical("failpoint %s: exiting abruptly", name)
            os._exit(77)

    # ---------------------------------------------------------------- begin
    @txtimer.label("begin")  # /metrics counts catalog transactions by these labels
    def begin(self, run: str, step: int, world_size: int, parent_id: int | None, attempt: str,
              rank: int = 0, generation: int = 0, expected_bytes: int = 0) -> Checkpoint:
        """`generation`: the caller's launch (domain/fencing.py); 0 for a client that did not register.
        `expected_bytes`: what this rank is about to upload (0: unknown); refused at once if
        the store cannot hold it, before any rank uploads a byte."""
        self.gate.check()
        fencing.check_names(run, attempt)
        if step < 0:
            raise InvalidArgument(f"step must be >= 0, got {step}")
        if not 1 <= world_size <= self.settings.max_world_size:
            raise InvalidArgument(f"world size must be 1..{self.settings.max_world_size}, got {world_size}")
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} is outside world size {world_size}")
        if generation < 0:
            raise InvalidArgument(f"generation must be >= 0, got {generation}")
        if expected_bytes < 0:
            raise InvalidArgument(f"expected_bytes must be >= 0, got {expected_bytes}")
        parent_id = parent_id or None
        for _ in range(3):
            try:
                return self._begin_once(run, step, world_size, parent_id, attempt, rank, generation, expected_bytes)
            except Fenced:
                fencing.record_refusal(self.sessions, run, None, what="begin", step=step, rank=rank,
                                       attempt=attempt, generation=generation)
                raise
            except IntegrityError:  # a concurrent begin of the same (run, step, attempt) won
                continue
        raise Conflict(f"concurrent begin of {run} step {step} attempt {attempt} did not settle")

    def _begin_once(self, run_name, step, world_size, parent_id, attempt, rank, generation,
                    expected_bytes) -> Checkpoint:
        with self.sessions() as s, s.begin():
            # FOR SHARE: a launch registering now (UPDATE runs) waits until this checkpoint
            # is recorded, and then abandons it with the rest of the fenced generation
            run = s.scalar(select(Run).where(Run.name == run_name).with_for_update(read=True))
            if run is None:
                run = Run(name=run_name, created_at=self.clock(), generation=0)
                s.add(run)
                s.flush()
            fencing.check(s, run.id, generation, f"begin of step {step}")
            ck = s.scalar(select(Checkpoint).where(
                Checkpoint.run_id == run.id, Checkpoint.step == step, Checkpoint.attempt == attempt))
            if ck is not None:
                if ck.world_size != world_size:
                    raise Conflict(f"checkpoint {ck.id} ({run_name} step {step} attempt {attempt}) has world size "
                                   f"{ck.world_size}; this rank says {world_size}")
                if (ck.parent_id or None) != parent_id:
                    raise Conflict(f"checkpoint {ck.id} has parent {ck.parent_id}; this rank says {parent_id}")
                if ck.status in (ABANDONED, CORRUPT):
                    raise FailedPrecondition(f"checkpoint {ck.id} ({run_name} step {step} attempt {attempt}) is "
                                             f"{ck.status}; save again under a new attempt")
                # the other ranks' begins of a storm find the lease fresh: they write nothing
                # (no WAL, no fsync), so 1,024 begins are one write and 1,023 reads
                if ck.status == PENDING and ck.lease_expires_at < self.lease_from_now() - self._lease_slack():
                    ck.lease_expires_at = self.lease_from_now()
                return ck
            if parent_id is not None:
                parent = s.get(Checkpoint, parent_id)
                if parent is None or parent.run_id != run.id:
                    raise NotFound(f"parent checkpoint {parent_id} does not exist in run {run_name}")
            # after the fencing check (a zombie hears Fenced, not "store full"), and only by the
            # begin that would create the checkpoint: a refused one leaves nothing pending
            self._require_room(expected_bytes)
            now = self.clock()
            ck = Checkpoint(run_id=run.id, step=step, attempt=attempt, world_size=world_size,
                            parent_id=parent_id, status=PENDING, bytes=0, lease_expires_at=self.lease_from_now(),
                            created_at=now, generation=generation)
            s.add(ck)
            s.flush()
            branches.settle(s, run.id, ck.id)  # its stored branch (domain/branches.py)
            add_event(s, "begin", run.id, ck.id, step=step, world_size=world_size, attempt=attempt, rank=rank)
            return ck

    # ---------------------------------------------------------------- put
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

        `adopt`: the chunks are read from this spooled shard (domain/spool.Taken); a blob
        store that can make that very file the blob does so instead of copying it.
        `hashed=False` (an adopted direct-FS file outside the `service` verification mode,
        domain/verification_modes.py): the file is published unread but for its header, and
        recorded DECLARED; the commit waits until a peer has checked it. `declared`: the
        range digests its writer declared for such a file (domain/declared_ranges.py).
        `follow`: `chunks` come from a spooled file its writer is still writing
        (domain/spool.Followed, `adopt` its Taken); the header has no hash, the writer's
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
        if not hashed:  # verification_modes.py: a peer checks the bytes; only the header is read here
            hasher = verification_modes.Declared(header.size, header.xxh3_128)
            chunks = verification_modes.header_chunks(adopt.fd, header.size, hasher, want_index,
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
                    fencing.check(s, ck.run_id, ck.generation, f"upload to checkpoint {ck.id}")
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
        rank (put_shard; direct uploads' grant, hand-over and record, domain/grants.py), in
        one place so the paths cannot drift apart: the checkpoint exists, the rank is one of
        it, its launch is not fenced; a file recorded already is answered as it is (the
        same bytes: already present; other bytes: Conflict); else the checkpoint must be
        PENDING and the rank must not have voted. Returns the checkpoint and, for a file
        recorded already, the answer. `lock`: take the checkpoint's row lock (serialises
        with votes). `what` names the operation in the errors."""
        ck = self.get_checkpoint(s, h.checkpoint_id, lock=lock)
        self.check_rank(ck, h.rank)
        fencing.check(s, ck.run_id, ck.generation, f"{what} to checkpoint {ck.id}")
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
        """The file's range digests (lastgood/ranges.py), fed from here on; the bytes so far
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

    # ---------------------------------------------------------------- vote and commit
    @txtimer.label("vote")
    def vote(self, checkpoint_id: int, rank: int, files: list[str], wait_seconds: float = 0.0) -> VoteResult:
        self.gate.check()
        if len(set(files)) != len(files):
            raise InvalidArgument("the vote lists a file twice")
        if not math.isfinite(wait_seconds):
            raise InvalidArgument(f"wait_seconds must be a finite number, got {wait_seconds}")
        # recorded in one transaction with the votes arriving together (votebatch.py), and
        # committed by one of them when they complete the checkpoint
        result = self.vote_batches.vote(checkpoint_id, rank, files)
        if result.status == PENDING and wait_seconds > 0:
            result = self.wait_for(checkpoint_id, min(wait_seconds, self.settings.commit_wait_max))
        if result.status == COMMITTED and self.settings.failpoint == "lose_commit_reply":
            raise RuntimeError("failpoint lose_commit_reply: the commit happened, its reply is lost")
        return result

    def wait_for(self, checkpoint_id: int, timeout: float) -> VoteResult:
        deadline = time.monotonic() + timeout
        while True:
            result = self._vote_state(checkpoint_id)
            left = deadline - time.monotonic()
            if result.status != PENDING or left <= 0:
                if result.status in (ABANDONED, CORRUPT):
                    with self.sessions() as s, s.begin():  # abandoned because a newer launch registered?
                        ck = self.get_checkpoint(s, checkpoint_id)
                        fencing.check(s, ck.run_id, ck.generation, f"vote on checkpoint {checkpoint_id}")
                    raise FailedPrecondition(f"checkpoint {checkpoint_id} is {result.status}")
                return result
            with self._changed:
                # woken by a commit in this process; the timeout re-reads the catalog, where
                # a commit by another replica shows up
                self._changed.wait(min(left, 0.25))

    def _vote_state(self, checkpoint_id: int) -> VoteResult:
        with self.sessions() as s, s.begin():
            ck = self.get_checkpoint(s, checkpoint_id)
            voted = set(s.scalars(select(Vote.rank).where(Vote.checkpoint_id == checkpoint_id)))
            return VoteResult(ck.id, ck.status, sorted(set(range(ck.world_size)) - voted))

    def commit_plan(self, s: Session, ck: Checkpoint) -> CommitPlan | None:
        """The manifest a PENDING checkpoint commits with, read in the caller's transaction;
        None while it cannot commit (not PENDING, a rank has not voted, a file is DECLARED)."""
        if ck.status != PENDING:
            return None
        checkpoint_id = ck.id
        run = s.get(Run, ck.run_id)
        # plain rows, not ORM objects: at 1,024 ranks building 2,048 instances was a third
        # of the commit's CPU, on the path every rank waits on (docs/control-plane.md)
        rows = s.execute(select(Vote.rank, Vote.files_json, Vote.created_at)
                         .where(Vote.checkpoint_id == checkpoint_id)).all()
        votes = {rank: set(json.loads(files)) for rank, files, _at in rows}
        shards = s.execute(select(Shard.rank, Shard.file_name, Shard.size, Shard.xxh3_128, Shard.status,
                                  Shard.index_json).where(Shard.checkpoint_id == checkpoint_id)).all()
        if set(votes) != set(range(ck.world_size)):
            return None
        if any(sh.status == DECLARED for sh in shards):  # a peer has yet to check it (verification_modes.py)
            return None
        by_rank: dict[int, list[FileEntry]] = {r: [] for r in votes}
        pfx = key_prefix(s, ck)
        for sh in shards:
            if sh.status != VERIFIED or sh.file_name not in votes.get(sh.rank, ()):
                raise FailedPrecondition(f"shard {sh.file_name!r} of rank {sh.rank} is not part of a vote")
            by_rank[sh.rank].append(indexes.entry(self.blobs, pfx, sh))  # a reference: O(files)
        if any({f.name for f in by_rank[r]} != votes[r] for r in votes):
            raise FailedPrecondition(f"checkpoint {checkpoint_id}: votes and verified shards disagree")
        manifest = Manifest(ck.id, run.name, ck.step, ck.attempt, ck.world_size, ck.parent_id, by_rank,
                            ck.generation or 0, version=2)
        # the last vote's time (the commit_seconds metric) from the rows read here: every rank
        # has voted, so no vote can come after it
        return CommitPlan(manifest, keys.manifest_key(pfx), run.id, max(at for _r, _f, at in rows))

    def try_commit(self, checkpoint_id: int, *, recovering: bool = False, plan: CommitPlan | None = None) -> bool:
        """Write the manifest, then commit in one transaction. True if this call committed.
        `plan`: what `commit_plan` found in the caller's own transaction, still holding the
        checkpoint's row lock (the peer report that verified the last file): not read again."""
        if self._fail_commit_once:  # testing only: a transient catalog error on the first attempt
            self._fail_commit_once = False
            raise RuntimeError("failpoint commit_fails_once: the commit's catalog transaction fails")
        if plan is None:
            with self.sessions() as s, s.begin():
                plan = self.commit_plan(s, self.get_checkpoint(s, checkpoint_id))
            if plan is None:
                return False
        manifest, key, run_id, last_vote = plan.manifest, plan.key, plan.run_id, plan.last_vote
        body = manifest.to_bytes()
        self._failpoint("crash_before_manifest")
        stored = self.blobs.stat(key)
        if stored is None or self.blobs.read_all(key) != body:
            if recovering:
                return False
            self._failpoint("hold_manifest")  # testing only: a slow manifest write, held by the test
            self.blobs.put_bytes(key, body)
        self._failpoint("crash_after_manifest")
        with self.sessions() as s, s.begin():
            # the run's row first: a launch registering now (domain/fencing.py) is ordered
            # strictly before or after this commit, never interleaved with it
            s.get(Run, run_id, with_for_update=True)
            now = self.clock()
            newest = select(Run.generation).where(Run.id == Checkpoint.run_id).scalar_subquery()
            won = s.execute(update(Checkpoint)
                            .where(Checkpoint.id == checkpoint_id, Checkpoint.status == PENDING,
                                   or_(Checkpoint.generation == 0, Checkpoint.generation >= newest))
                            .values(status=COMMITTED, committed_at=now, bytes=manifest.total_bytes(),
                                    manifest_key=key, manifest_hash=hash_bytes(body))).rowcount == 1
            if won:
                ck = s.get(Checkpoint, checkpoint_id)  # not loaded before in this session: the updated row
                branches.settle(s, ck.run_id, ck.id)  # committed: its stored branch and later ones'
                moved = last_good.advance(s, ck)
                add_event(s, "commit", ck.run_id, ck.id, step=ck.step, bytes=ck.bytes, last_good=moved,
                          recovered=recovering)
                save_s, commit_s = (now - ck.created_at).total_seconds(), (now - last_vote).total_seconds()
        if won:
            log.info("committed checkpoint %s (%s step %s)", checkpoint_id, manifest.run, manifest.step,
                     extra={"run": manifest.run, "checkpoint_id": checkpoint_id, "step": manifest.step})
            self.metrics.commits.inc()
            self.metrics.save_seconds.observe(save_s)
            self.metrics.commit_seconds.observe(commit_s)
            self._notify({checkpoint_id: COMMITTED})  # after the transaction: COMMITTED is durable
        return won
