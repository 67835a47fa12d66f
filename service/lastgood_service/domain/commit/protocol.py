"""The two-phase commit protocol: begin, put (put.py), vote, commit.

Invariants (docs/architecture.md), and where this module keeps them:
  I1 no acknowledged commit is lost: a rank hears COMMITTED only after the one transaction
     that marks the checkpoint COMMITTED and moves last-good has committed; blobs were
     published durably (fsync + rename + fsync dir) before they were recorded VERIFIED.
  I2 nothing is visible unless complete: a checkpoint becomes COMMITTED only when every
     rank voted with exactly its verified files (each vote checked where it is written,
     votebatch.py, and all of them again by try_commit; reads.py serves COMMITTED
     checkpoints only; verification.py re-hashes and marks CORRUPT).
  I3 last-good moves forward only in the commit transaction (domain/runs/last_good.py, advance);
     a failed save never touches it.
Commit is exactly-once under races: the status change is a conditional UPDATE
(`WHERE status = 'PENDING'`), so of two committers, or a committer and the lease reaper
(lifecycle.py), exactly one wins. No database work happens per chunk.
"""

from __future__ import annotations

import json
import logging
import math
import time

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from lastgood.wire import peerkey, sealing
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import FileEntry, Manifest

from ...catalog import txtimer
from ...catalog.models import (ABANDONED, COMMITTED, CORRUPT, DECLARED, DURABLE, MEMORY, PENDING, VERIFIED, Checkpoint,
                               Run,
                               Shard, Vote)
from ...failpoints import Failpoint, reach
from .. import keys
from ..errors import Conflict, FailedPrecondition, Fenced, HashMismatch, InvalidArgument, NotFound, TooLarge
from ..events import add_event
from ..runs import branches, fencing, last_good
from . import indexes, tiering
from .core import key_prefix
from .put import CommitPut, read_header
from .types import CommitPlan, ShardHeader, VoteResult

log = logging.getLogger("lastgood.commit")


class CommitProtocol(CommitPut):
    """begin, vote and commit, on the put of files (put.py)."""

    def _failpoint(self, point: Failpoint) -> None:
        """A crash or hold point of the commit (failpoints.reach), armed by settings.failpoint."""
        reach(point, self.settings.failpoint, self.settings.data_dir)

    # ---------------------------------------------------------------- begin
    @txtimer.label("begin")  # /metrics counts catalog transactions by these labels
    def begin(self, run: str, step: int, world_size: int, parent_id: int | None, attempt: str,
              rank: int = 0, generation: int = 0, expected_bytes: int = 0, tier: str = "",
              replicas: int = 0) -> Checkpoint:
        """`generation`: the caller's launch (domain/runs/fencing.py); 0 for a client that did not register.
        `expected_bytes`: what this rank is about to upload (0: unknown); refused at once if
        the store cannot hold it, before any rank uploads a byte. `tier`, `replicas`: a memory
        checkpoint's (domain/memory/tiering.py), "" and 0 for a durable one."""
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
        tier, replicas = tiering.tier_of(tier, replicas)
        for _ in range(3):
            try:
                ck = self._begin_once(run, step, world_size, parent_id, attempt, rank, generation, expected_bytes,
                                      tier, replicas)
                if world_size == 1:
                    self.vote_batches.alone(ck.id)  # its vote skips the batch window (votebatch.py)
                return ck
            except Fenced:
                fencing.record_refusal(self.sessions, run, None, what="begin", step=step, rank=rank,
                                       attempt=attempt, generation=generation)
                raise
            except IntegrityError:  # a concurrent begin of the same (run, step, attempt) won
                continue
        raise Conflict(f"concurrent begin of {run} step {step} attempt {attempt} did not settle")

    def _begin_once(self, run_name, step, world_size, parent_id, attempt, rank, generation,
                    expected_bytes, tier=DURABLE, replicas=0) -> Checkpoint:
        with self.sessions() as s, s.begin():
            # FOR SHARE: a launch registering now (UPDATE runs) waits until this checkpoint
            # is recorded, and then abandons it with the rest of the fenced generation
            run = s.scalar(select(Run).where(Run.name == run_name).with_for_update(read=True))
            if run is None:
                run = Run(name=run_name, created_at=self.clock(), generation=0)
                s.add(run)
                s.flush()
            fencing.check(s, run.id, generation, f"begin of step {step}", writes_checkpoints=True)
            ck = s.scalar(select(Checkpoint).where(
                Checkpoint.run_id == run.id, Checkpoint.step == step, Checkpoint.attempt == attempt))
            if ck is not None:
                if ck.world_size != world_size:
                    raise Conflict(f"checkpoint {ck.id} ({run_name} step {step} attempt {attempt}) has world size "
                                   f"{ck.world_size}; this rank says {world_size}")
                if (ck.parent_id or None) != parent_id:
                    raise Conflict(f"checkpoint {ck.id} has parent {ck.parent_id}; this rank says {parent_id}")
                if (ck.tier, ck.replicas) != (tier, replicas):
                    raise Conflict(f"checkpoint {ck.id} is {ck.tier} with {ck.replicas} replicas; this rank says "
                                   f"{tier} with {replicas}")
                if ck.status in (ABANDONED, CORRUPT):
                    raise FailedPrecondition(f"checkpoint {ck.id} ({run_name} step {step} attempt {attempt}) is "
                                             f"{ck.status}; save again under a new attempt")
                # the other ranks' begins of a storm find the lease fresh: they write nothing
                # (no WAL, no fsync), so 1,024 begins are one write and 1,023 reads
                if ck.status == PENDING and ck.lease_expires_at < self.lease_from_now() - self._lease_slack():
                    ck.lease_expires_at = self.lease_from_now()
                return ck
            parent = None
            if parent_id is not None:
                parent = s.get(Checkpoint, parent_id)
                if parent is None or parent.run_id != run.id:
                    raise NotFound(f"parent checkpoint {parent_id} does not exist in run {run_name}")
            # after the fencing check (a zombie hears Fenced, not "store full"), and only by the
            # begin that would create the checkpoint: a refused one leaves nothing pending
            if tier == DURABLE:  # a memory checkpoint's files take no room in the store
                self._require_room(expected_bytes)
            now = self.clock()
            ck = Checkpoint(run_id=run.id, step=step, attempt=attempt, world_size=world_size,
                            parent_id=parent_id, status=PENDING, bytes=0, lease_expires_at=self.lease_from_now(),
                            created_at=now, generation=generation, tier=tier, replicas=replicas,
                            branch=branches.of_begun(parent))  # its stored branch (domain/runs/branches.py)
            s.add(ck)
            s.flush()
            add_event(s, "begin", run.id, ck.id, step=step, world_size=world_size, attempt=attempt, rank=rank,
                      **({"tier": tier, "replicas": replicas} if tier != DURABLE else {}))
            return ck

    # ---------------------------------------------------------------- vote and commit
    @txtimer.label("vote")
    def vote(self, checkpoint_id: int, rank: int, files: list[str], wait_seconds: float = 0.0,
             peer_key: str = "", memory_files: list | None = None,
             inline_files: list | None = None) -> VoteResult:
        """`peer_key`: the commitment of the rank's peer-check secret (lastgood/wire/peerkey.py), or "".
        `memory_files`: a memory checkpoint's files, declared by this vote (tiering.py); `files`
        then names exactly them, or nothing. `inline_files`: small files (name, xxh3-128, bytes)
        that travel with the vote, each taken as put_shard takes a streamed one before the
        vote is recorded (a small state's save: one call fewer); `files` names them too."""
        self.gate.check()
        if memory_files:
            if inline_files:
                raise InvalidArgument("a memory vote declares its files; it carries no bytes (inline_files)")
            files = self._declare_memory(checkpoint_id, rank, files, memory_files)
        if inline_files:
            self._take_inline(checkpoint_id, rank, files, inline_files)
        if len(set(files)) != len(files):
            raise InvalidArgument("the vote lists a file twice")
        if peer_key and not peerkey.is_commitment(peer_key):
            raise InvalidArgument("peer_key must be 64 lowercase hex digits (a SHA-256) or empty")
        if not math.isfinite(wait_seconds):
            raise InvalidArgument(f"wait_seconds must be a finite number, got {wait_seconds}")
        # recorded in one transaction with the votes arriving together (votebatch.py), and
        # committed by one of them when they complete the checkpoint
        result = self.vote_batches.vote(checkpoint_id, rank, files, peer_key)
        if result.status == PENDING and wait_seconds > 0:
            result = self.wait_for(checkpoint_id, min(wait_seconds, self.settings.commit_wait_max))
        if result.status == COMMITTED and self.settings.failpoint == Failpoint.LOSE_COMMIT_REPLY:
            raise RuntimeError("failpoint lose_commit_reply: the commit happened, its reply is lost")
        return result

    def _take_inline(self, checkpoint_id: int, rank: int, files: list[str], inline_files: list) -> None:
        """The files a vote carries (CommitRank.inline_files), each put as a one-chunk stream
        would be: checked, hashed, published durably and recorded VERIFIED, or refused with
        nothing recorded; a file recorded already with the same bytes (the vote sent again
        after a lost reply) is already present. Every file is checked before any is written
        (its name, size, hash, a safetensors file's header), so one bad file leaves the others
        unrecorded too: in all at most settings.inline_bytes, each named once and among the
        vote's `files`."""
        total = sum(len(f.data) for f in inline_files)
        if total > self.settings.inline_bytes:
            raise TooLarge(f"a vote carries {total} bytes of files; this service takes at most "
                           f"{self.settings.inline_bytes} (GET /api/v1/info: inline_bytes): stream them")
        inline = [f.name for f in inline_files]
        if len(set(inline)) != len(inline) or not set(inline) <= set(files):
            raise InvalidArgument("each file a vote carries is named once, and among the vote's files")
        headers = [ShardHeader(checkpoint_id, rank, f.name, len(f.data), f.xxh3_128) for f in inline_files]
        for h, f in zip(headers, inline_files):
            self.check_header(h)
            digest = hash_bytes(f.data)
            if digest != h.xxh3_128:
                self.record_mismatch(h, digest)
                raise HashMismatch(f"xxh3-128 of {h.file_name}'s bytes is {digest}, the client declared "
                                   f"{h.xxh3_128}: the vote and its files are refused")
            if h.file_name.endswith(".safetensors"):
                read_header(bytearray(f.data), h.size, final=True)
        for h, f in zip(headers, inline_files):
            self.put_shard(h, (f.data,))

    def _declare_memory(self, checkpoint_id: int, rank: int, files: list[str], memory_files: list) -> list[str]:
        """Record a memory vote's files DECLARED before the vote itself (tiering.declare); the
        names the vote then lists. A copy already reported with other bytes aborts the checkpoint."""
        memory_files = [tiering.MemoryFile(f.name, f.size, f.xxh3_128) for f in memory_files]
        tiering.check_files(memory_files)
        declared = [f.name for f in memory_files]
        if files and sorted(files) != sorted(declared):
            raise InvalidArgument("a memory vote's files are exactly its memory_files (or left empty)")
        with self.sessions() as s, s.begin():
            ck = self.get_checkpoint(s, checkpoint_id, lock=True)  # serialised with copy reports
            self.check_rank(ck, rank)
            fencing.check(s, ck.run_id, ck.generation, f"vote on checkpoint {ck.id}", writes_checkpoints=True)
            bad = tiering.declare(s, self, ck, rank, memory_files, self.clock())
            reason = tiering.abandon(s, self, ck, bad) if bad else None
        if reason:
            self.ended_by_contest(checkpoint_id)
            raise FailedPrecondition(f"checkpoint {checkpoint_id} is ABANDONED: {reason}")
        return declared

    def wait_for(self, checkpoint_id: int, timeout: float) -> VoteResult:
        deadline = time.monotonic() + timeout
        while True:
            result = self._vote_state(checkpoint_id)
            left = deadline - time.monotonic()
            if result.status != PENDING or left <= 0:
                if result.status in (ABANDONED, CORRUPT):
                    with self.sessions() as s, s.begin():  # abandoned because a newer launch registered?
                        ck = self.get_checkpoint(s, checkpoint_id)
                        fencing.check(s, ck.run_id, ck.generation, f"vote on checkpoint {checkpoint_id}",
                                      writes_checkpoints=True)
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
        # plain rows, not ORM objects: at 1,024 ranks building 2,048 instances would be a
        # third of the commit's CPU, on the path every rank waits on (docs/control-plane.md)
        rows = s.execute(select(Vote.rank, Vote.files_json, Vote.created_at)
                         .where(Vote.checkpoint_id == checkpoint_id)).all()
        votes = {rank: set(json.loads(files)) for rank, files, _at in rows}
        shards = s.execute(select(Shard.rank, Shard.file_name, Shard.size, Shard.xxh3_128, Shard.status,
                                  Shard.index_json).where(Shard.checkpoint_id == checkpoint_id)).all()
        if set(votes) != set(range(ck.world_size)):
            return None
        if any(sh.status == DECLARED for sh in shards):  # a peer has yet to check it (peer/verification_modes.py)
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

    def _seals(self, stored: bytes, unsealed: bytes) -> bool:
        """Whether `stored` is `unsealed` under a seal of one of the service's keys."""
        try:
            return self.manifest_keys.unseal(stored)[0] == unsealed
        except ValueError:
            return False

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
        unsealed = manifest.to_bytes()
        body = self.manifest_keys.seal(unsealed)  # the store's copy proves itself (domain/sealing.py)
        self._failpoint(Failpoint.CRASH_BEFORE_MANIFEST)
        stored = self.blobs.read_all(key) if self.blobs.stat(key) is not None else None
        if stored is not None and stored != body:
            if self._seals(stored, unsealed):
                body = stored  # this manifest, sealed by a key since rotated out of first place: kept
            elif recovering and sealing.content(stored) == unsealed:
                # written by a process with other keys (a replica, a start with lost keys): the
                # catalog's rows say the same, so it is resealed with this one's and committed
                self.blobs.put_bytes(key, body)
                stored = body
        if stored != body:
            if recovering:
                return False
            self._failpoint(Failpoint.HOLD_MANIFEST)  # testing only: a slow manifest write, held by the test
            self.blobs.put_bytes(key, body)
        self._failpoint(Failpoint.CRASH_AFTER_MANIFEST)
        memory = False
        with self.sessions() as s, s.begin():
            # the run's row first: a launch registering now (domain/runs/fencing.py) is ordered
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
                last_good.move_durable_tag(s, ck)  # a durable commit: the last-good-durable tag moves with it
                add_event(s, "commit", ck.run_id, ck.id, step=ck.step, bytes=ck.bytes, last_good=moved,
                          recovered=recovering)
                save_s, commit_s = (now - ck.created_at).total_seconds(), (now - last_vote).total_seconds()
                memory = ck.tier == MEMORY
        if won:
            log.info("committed checkpoint %s (%s step %s)", checkpoint_id, manifest.run, manifest.step,
                     extra={"run": manifest.run, "checkpoint_id": checkpoint_id, "step": manifest.step})
            self.metrics.commits.inc()
            self.metrics.save_seconds.observe(save_s)
            self.metrics.commit_seconds.observe(commit_s)
            self._notify({checkpoint_id: COMMITTED})  # after the transaction: COMMITTED is durable
            if memory:
                self.memory_committed.set()
        return won
