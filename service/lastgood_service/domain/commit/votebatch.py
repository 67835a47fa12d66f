"""Group commit of votes: the votes that arrive together are written in ONE transaction.

At 1,024 ranks every rank votes within the same second. Written one transaction each,
under the checkpoint's row lock, each also counting and re-reading every vote before it, a
checkpoint would cost O(ranks) catalog transactions and O(ranks^2) rows read, and on
SQLite every transaction appends its own pages to the WAL. So a vote joins a queue; one of
the waiting voters (the leader) takes everything queued - what arrived while the previous
batch was being written, and within `vote_batch_window` seconds after - and writes it:

- one transaction per batch, whatever the number of checkpoints and ranks in it: each
  checkpoint's row is locked (in id order, so two replicas' batches cannot deadlock), its
  votes in the batch are checked against the rank's verified shards read in one query,
  written, and the voted ranks are read back in one query (the count that says "all ranks
  voted", and the missing ranks the answer carries);
- a vote on a checkpoint of one rank, begun through this process, skips the window: no
  other vote of it can join, so its leader writes what is queued at once (the fixed cost
  of a tiny single-rank save, docs/performance.md); the votes of other single-rank jobs
  that arrive while it is written still join the next batch;
- a voter's answer leaves only after its batch's transaction has committed (a vote is
  durable when acknowledged);
- a vote the protocol refuses (wrong files, a checkpoint not PENDING, fenced) is refused
  to that voter alone and writes nothing; the others in the batch are written;
- each checkpoint's part of the batch runs under its own SAVEPOINT: an SQL error in it (a
  deadlock, a lock timeout) rolls back that part only, and only its voters hear
  Unavailable: vote again;
- a batch whose transaction fails (a catalog error, a lost connection) has written nothing
  (rolled back as a whole) and every voter in it hears Unavailable: vote again;
- the batch that completes a checkpoint has one of its voters commit it (the protocol's
  try_commit), unless a commit of that checkpoint is already under way in this process (a
  vote sent again while the manifest is written), or a file of it is still DECLARED (peer
  mode: the report or the service's own hash that verifies the last one commits, under the
  same row lock: domain/peer/verification_modes.py); the others answer PENDING at once,
  with no missing ranks, like any vote of an incomplete checkpoint: the caller waits for
  the outcome as its wait_seconds allows (protocol.vote, bounded by commit_wait_max and
  the gRPC waiters' limit), never for a slow manifest write it did not ask to wait for.

The protocol's checks and invariants are protocol.py's (I1-I3); this module only groups.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from sqlalchemy import insert, select, text
from sqlalchemy.exc import SQLAlchemyError

from ...catalog.models import ABANDONED, COMMITTED, CORRUPT, DECLARED, PENDING, Shard, Vote
from ...failpoints import Failpoint
from ..events import add_event
from ..runs import fencing
from ..errors import Conflict, DomainError, FailedPrecondition, Unavailable
from ..faults import as_domain_error
from .types import VoteResult

log = logging.getLogger("lastgood.commit")

MAX_BATCH = 2048  # votes a transaction writes at most (bounds its IN lists and its length)
MAX_SOLO = 4096  # single-rank checkpoints remembered (the newest begun): a bound on the hint's memory


@dataclass(eq=False)
class _Ask:
    checkpoint_id: int
    rank: int
    files: list[str]
    peer_key: str | None = None  # the commitment of the rank's peer-check secret (lastgood/wire/peerkey.py)
    done: bool = False
    error: BaseException | None = None
    status: str = PENDING
    missing: list[int] = field(default_factory=list)
    completes: bool = False  # its batch completed the checkpoint: someone must commit it
    contested: bool = False  # its peer key was not the one the rank voted with: the checkpoint is abandoned
    plan: object = None  # the CommitPlan its batch read under the row lock when it completed the checkpoint


class VoteBatcher:
    """One per commit service (process). `core` is the CommitProtocol: its sessions, checks
    (get_checkpoint, check_rank, require_pending), clock and lease, and try_commit."""

    def __init__(self, core, window: float, failpoint: str | None = None) -> None:
        self.core = core
        self.window = window
        self._cv = threading.Condition()
        self._queue: list[_Ask] = []
        self._writing = False
        # testing only (settings.failpoint): the first batch fails, or an SQL error in one checkpoint's parts
        point, checkpoint_id = Failpoint.parse(failpoint) if failpoint else (None, None)
        self._fail_next = point is Failpoint.VOTE_BATCH_FAILS_ONCE
        self._fail_checkpoint = checkpoint_id if point is Failpoint.VOTE_FAILS_ON_CHECKPOINT else None
        self._committing: set[int] = set()  # checkpoints a voter of this process is committing
        self._solo: dict[int, None] = {}  # single-rank checkpoints begun here, oldest first (a hint only)
        self.batches = 0  # transactions written, for tests and the benchmark
        self.unwaited = 0  # batches whose leader skipped the window (a single-rank vote), for tests

    def alone(self, checkpoint_id: int) -> None:
        """The checkpoint has one rank (protocol.begin says so): its vote need not wait for
        others. A hint: a checkpoint begun through another replica just waits the window."""
        with self._cv:
            self._solo[checkpoint_id] = None
            if len(self._solo) > MAX_SOLO:
                del self._solo[next(iter(self._solo))]

    def committing(self, checkpoint_id: int) -> bool:
        """Is a voter of this process committing the checkpoint (domain/peer/peer_fallback.py asks)?"""
        with self._cv:
            return checkpoint_id in self._committing

    def vote(self, checkpoint_id: int, rank: int, files: list[str], peer_key: str | None = None):
        """Record the vote (durably, in some batch's transaction), commit if its batch
        completed the checkpoint; the VoteResult as of then. Raises the vote's own refusal."""
        ask = _Ask(checkpoint_id, rank, list(files), peer_key or None)
        self._submit(ask)
        if ask.contested:  # the checkpoint was abandoned in the batch's transaction: say so, once written
            self.core.ended_by_contest(checkpoint_id)
        if ask.error is not None:
            # the error object may be shared by the whole batch: each voter raises its own
            # copy (one exception raised in many threads would share one traceback)
            raise copy.copy(ask.error)
        result = VoteResult(checkpoint_id, ask.status, ask.missing)
        if not ask.completes:
            return result
        with self._cv:
            if checkpoint_id in self._committing:
                return result  # a voter is committing it: PENDING now, the caller waits as it may
            self._committing.add(checkpoint_id)
        try:
            # the plan read in the batch's transaction: try_commit need not read it again
            if self.core.try_commit(checkpoint_id, plan=ask.plan):  # this call committed it: no need to read it back
                return VoteResult(checkpoint_id, COMMITTED, [])
            return self.core.wait_for(checkpoint_id, 0.0)
        except Exception as e:
            log.warning("commit of checkpoint %s by rank %s's vote failed (its batch's other voters "
                        "heard PENDING): %s", checkpoint_id, rank, e, extra={"checkpoint_id": checkpoint_id})
            raise
        finally:
            with self._cv:
                self._committing.discard(checkpoint_id)

    # ------------------------------------------------------------------ the queue
    def _submit(self, ask: _Ask) -> None:
        with self._cv:
            self._queue.append(ask)
            while True:
                while self._writing and not ask.done:
                    self._cv.wait()
                if ask.done:
                    return
                self._writing = True  # this voter leads the next batch
                self._cv.release()
                batch: list[_Ask] = []
                written = False
                try:
                    with self._cv:
                        solo = self._solo.pop(ask.checkpoint_id, 0) is None
                    if solo:
                        self.unwaited += 1
                    elif self.window > 0:
                        time.sleep(self.window)  # let the votes arriving with this one join it
                    with self._cv:
                        batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
                    self._write(batch)
                    written = True
                finally:
                    self._cv.acquire()
                    for a in batch:
                        if not written:  # interrupted: whether it committed is unknown, say so
                            a.error, a.completes = Unavailable("vote interrupted before its batch was answered: "
                                                               "vote again"), False
                        a.done = True
                    self._writing = False
                    self._cv.notify_all()

    def _write(self, batch: list[_Ask]) -> None:
        try:
            self._record(batch)
            self.batches += 1
        except Exception as e:  # noqa: BLE001 - the transaction rolled back: nothing of the batch is written
            log.warning("a batch of %d votes was not recorded (rolled back): %s", len(batch), e)
            self._fail(batch, e, f"the catalog transaction of its batch of {len(batch)} votes failed")

    @staticmethod
    def _fail(asks: list[_Ask], e: Exception, what: str) -> None:
        """Answer these voters with what the failure means: vote again, nothing of theirs is written."""
        known = as_domain_error(e)
        err = known if known is not None and not isinstance(known, FailedPrecondition) else Unavailable(
            f"vote not recorded: {what} ({type(e).__name__}); nothing of it was written: vote again")
        for a in asks:
            a.error, a.completes, a.contested, a.plan = err, False, False, None

    def _contest(self, s, ck, a: _Ask) -> Conflict:
        """A vote again for a rank that voted with another peer key (lastgood/wire/peerkey.py):
        two processes claim the rank - a rank of the job voting in another's name, or a
        client bug. Either may have filed the rank's peer checks, so no check of its files
        can be trusted: the checkpoint is abandoned here, under its row lock, with a
        peer_key_contested event, and this vote is refused."""
        reason = (f"rank {a.rank}'s vote on checkpoint {ck.id} was claimed twice with different peer keys; "
                  f"the checkpoint is not committed")
        if ck.status == PENDING:
            ck.status, ck.lease_expires_at = ABANDONED, self.core.clock()
            add_event(s, "peer_key_contested", ck.run_id, ck.id, rank=a.rank)
            add_event(s, "abort", ck.run_id, ck.id, reason=reason, rank=a.rank)
            a.contested = True
        log.warning("checkpoint %s: %s", ck.id, reason, extra={"checkpoint_id": ck.id, "rank": a.rank})
        return Conflict(reason)

    # ------------------------------------------------------------------ the transaction
    def _record(self, batch: list[_Ask]) -> None:
        by_checkpoint: dict[int, list[_Ask]] = defaultdict(list)
        for a in batch:
            a.error, a.completes, a.contested, a.plan = None, False, False, None
            by_checkpoint[a.checkpoint_id].append(a)
        with self.core.sessions() as s, s.begin():
            for cid in sorted(by_checkpoint):  # row locks in id order: batches of two replicas cannot deadlock
                asks = by_checkpoint[cid]
                try:
                    # a SAVEPOINT per checkpoint: an SQL error in its part (a deadlock, a lock
                    # timeout) takes back that part only and fails its voters, not the batch's others
                    with s.begin_nested():
                        self._record_checkpoint(s, cid, asks)
                        if cid == self._fail_checkpoint:
                            s.execute(text("SELECT no_such_column FROM checkpoints"))  # a real SQL error
                except SQLAlchemyError as e:
                    log.warning("the %d votes on checkpoint %s in a batch were not recorded (rolled back to "
                                "its savepoint): %s", len(asks), cid, e, extra={"checkpoint_id": cid})
                    self._fail(asks, e, f"the catalog failed on checkpoint {cid}'s part of its batch")
            if self._fail_next:
                self._fail_next = False
                s.flush()  # the votes are in the transaction: the rollback must take them all back
                raise RuntimeError("failpoint vote_batch_fails_once: the batch's transaction fails")

    def _record_checkpoint(self, s, cid: int, asks: list[_Ask]) -> None:
        core = self.core
        try:
            ck = core.get_checkpoint(s, cid, lock=True)  # serialises with shard records and other batches
            fencing.check(s, ck.run_id, ck.generation, f"vote on checkpoint {ck.id}", writes_checkpoints=True)
        except DomainError as e:
            for a in asks:
                a.error = e
            return
        ok: list[_Ask] = []
        for a in asks:
            try:
                core.check_rank(ck, a.rank)
                ok.append(a)
            except DomainError as e:
                a.error = e
        ranks = sorted({a.rank for a in ok})
        prior_votes = {v.rank: v for v in s.scalars(
            select(Vote).where(Vote.checkpoint_id == cid, Vote.rank.in_(ranks)))} if ranks else {}
        voted_files = {r: json.loads(v.files_json) for r, v in prior_votes.items()}
        voted_keys = {r: v.peer_key for r, v in prior_votes.items()}
        have: dict[int, set[str]] = defaultdict(set)
        if unvoted := [r for r in ranks if r not in voted_files]:
            for rank, name in s.execute(select(Shard.rank, Shard.file_name).where(
                    Shard.checkpoint_id == cid, Shard.rank.in_(unvoted))):
                have[rank].add(name)
        rows: list[dict] = []
        for a in ok:
            try:
                prior = voted_files.get(a.rank)
                if prior is not None:
                    if voted_keys.get(a.rank) != a.peer_key:
                        raise self._contest(s, ck, a)
                    if sorted(prior) != sorted(a.files):
                        raise Conflict(f"rank {a.rank} already voted on checkpoint {cid} with other files")
                    continue
                core.require_pending(ck, "vote")
                missing = sorted(set(a.files) - have[a.rank])
                extra = sorted(have[a.rank] - set(a.files))
                if missing:
                    raise FailedPrecondition(f"rank {a.rank} votes for files that are not verified: {missing}")
                if extra:
                    raise FailedPrecondition(f"rank {a.rank} uploaded files its vote leaves out: {extra}")
                rows.append({"checkpoint_id": cid, "rank": a.rank, "files_json": json.dumps(sorted(a.files)),
                             "created_at": core.clock(), "peer_key": a.peer_key})
                voted_files[a.rank] = sorted(a.files)  # the same rank twice in one batch: one vote
                voted_keys[a.rank] = a.peer_key
            except DomainError as e:
                a.error = e
        if rows:
            # one multi-row INSERT, not an ORM object per vote: the rows are only written
            # (about a quarter of the CPU of building and flushing 1,024 Vote objects)
            s.execute(insert(Vote), rows)
            ck.lease_expires_at = core.lease_from_now()
            s.flush()
        accepted = [a for a in ok if a.error is None]
        if not accepted:
            return
        # one read of the voted ranks per checkpoint per batch (an index-only scan): the
        # count that decides the commit, and the missing ranks every answer carries
        voted = set(s.scalars(select(Vote.rank).where(Vote.checkpoint_id == cid)))
        missing_ranks = sorted(set(range(ck.world_size)) - voted)
        if ck.status in (ABANDONED, CORRUPT):  # a vote again on a checkpoint decided so
            for a in accepted:
                a.error = FailedPrecondition(f"checkpoint {cid} is {ck.status}")
            return
        # in `peer` mode the votes come before the checks: a completing vote with a file still
        # DECLARED cannot commit, and its try_commit (every vote and file read back, then a
        # read of the status) would be wasted. The last report to verify a file, serialised with
        # this batch by the checkpoint's row lock, sees every vote and commits it instead
        # (domain/peer/verification_modes.py, report; peer_fallback.py)
        completes = ck.status == PENDING and not missing_ranks and s.scalar(select(Shard.id).where(
            Shard.checkpoint_id == cid, Shard.status == DECLARED).limit(1)) is None
        plan = None
        if completes:
            # the manifest's plan, read here under the row lock (as the peer report that verifies
            # the last file does): the committing voter's try_commit does not read it again
            try:
                plan = core.commit_plan(s, ck)  # reads only: a refusal leaves the transaction as it was
            except DomainError:
                plan = None  # try_commit reads it again, and raises what it finds
        for a in accepted:
            a.status, a.missing, a.completes, a.plan = ck.status, missing_ranks, completes, plan
