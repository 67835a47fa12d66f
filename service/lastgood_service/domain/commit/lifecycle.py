"""How a checkpoint that will not commit ends, and how one that did survives a crash:
abort (a rank gave up), lease expiry (a rank died), start-up recovery (the service died
between the manifest and the commit transaction)."""

from __future__ import annotations

import datetime as dt
import logging

from sqlalchemy import func, select, update

from ...catalog.models import ABANDONED, PENDING, Checkpoint, Shard, Vote
from .. import keys
from ..errors import FailedPrecondition
from ..events import add_event
from .core import key_prefix
from .protocol import CommitProtocol

log = logging.getLogger("lastgood.commit")


class CommitLifecycle(CommitProtocol):
    """Recovery rolls forward through the protocol's own commit, hence the base class."""

    def abort(self, checkpoint_id: int, reason: str = "", rank: int | None = None) -> str:
        self.gate.check()
        with self.sessions() as s, s.begin():
            ck = self.get_checkpoint(s, checkpoint_id)
            if ck.status == ABANDONED:
                return ABANDONED
            if ck.status != PENDING:
                raise FailedPrecondition(f"cannot abort checkpoint {checkpoint_id}: it is {ck.status}")
            s.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.status == PENDING)
                      .values(status=ABANDONED, lease_expires_at=self.clock()))  # the lease ends here
            add_event(s, "abort", ck.run_id, ck.id, reason=reason[:1000], rank=rank)
        log.warning("checkpoint %s aborted by rank %s: %s", checkpoint_id, rank, reason[:200],
                    extra={"checkpoint_id": checkpoint_id, "rank": rank})
        self.metrics.abandoned.labels("abort").inc()
        self._notify()
        self._ended([checkpoint_id])
        return ABANDONED

    next_expiry: dt.datetime | None = None  # the earliest lease left PENDING by the last expire_leases

    def expire_leases(self) -> list[int]:
        """Mark PENDING checkpoints whose lease ran out ABANDONED (a rank died). Notes the
        earliest lease still pending in `next_expiry` (None: nothing pending): the lease
        reaper has nothing to do before it (reaper.py)."""
        now = self.clock()
        with self.sessions() as s, s.begin():
            # updated (row-locked) in id order, as vote batches lock them: in any other order
            # a batch and this pass could deadlock, and PostgreSQL would fail the whole batch
            due = list(s.scalars(select(Checkpoint).where(Checkpoint.status == PENDING,
                                                          Checkpoint.lease_expires_at < now)
                                 .order_by(Checkpoint.id)))
            expired = []
            for ck in due:
                if s.execute(update(Checkpoint)
                             .where(Checkpoint.id == ck.id, Checkpoint.status == PENDING,
                                    Checkpoint.lease_expires_at < now)
                             .values(status=ABANDONED)).rowcount == 1:
                    voted = sorted(s.scalars(select(Vote.rank).where(Vote.checkpoint_id == ck.id)))
                    add_event(s, "expired", ck.run_id, ck.id, step=ck.step, voted_ranks=voted)
                    expired.append(ck.id)
            # an index seek (ix_checkpoints_status_lease)
            self.next_expiry = s.scalar(select(func.min(Checkpoint.lease_expires_at))
                                        .where(Checkpoint.status == PENDING))
        if expired:
            for cid in expired:
                log.warning("lease expired: checkpoint %s abandoned (a rank stopped)", cid,
                            extra={"checkpoint_id": cid})
            self.metrics.abandoned.labels("lease_expired").inc(len(expired))
            self._notify()
            self._ended(expired)
        return expired

    def ended_by_contest(self, checkpoint_id: int) -> None:
        """A vote batch abandoned the checkpoint: a rank's vote was claimed with two peer keys
        (votebatch.py, _contest). What abort does after its transaction."""
        self.metrics.abandoned.labels("abort").inc()
        self._notify()
        self._ended([checkpoint_id])

    def _ended(self, checkpoint_ids: list[int]) -> None:
        """Tell the end listeners of checkpoints that ended without a commit (core.py)."""
        for listener in self.end_listeners:
            listener(checkpoint_ids)

    def shards_present(self, checkpoint_id: int) -> bool:
        """Is every shard row's blob in the store at its recorded size (a stat each, no
        read)? Asked before a commit that does not follow the call that verified the files
        (recovery at start-up, peer mode's retried commit: domain/peer/peer_fallback.py): a crash of the
        host since may have lost blobs that were published but not yet on disk."""
        with self.sessions() as s, s.begin():
            shards = list(s.scalars(select(Shard).where(Shard.checkpoint_id == checkpoint_id)))
        return all((info := self.blobs.stat(sh.blob_key)) is not None and info.size == sh.size for sh in shards)

    def recover(self) -> list[int]:
        """At start-up: roll a PENDING checkpoint forward when every rank voted, its manifest
        blob is written and every verified shard is present; leave the rest to expiry."""
        with self.sessions() as s, s.begin():
            pending = [(ck.id, keys.manifest_key(key_prefix(s, ck)))
                       for ck in s.scalars(select(Checkpoint).where(Checkpoint.status == PENDING))]
        rolled = []
        for cid, key in pending:
            if self.blobs.stat(key) is None:
                continue
            if self.shards_present(cid):
                if self.try_commit(cid, recovering=True):
                    rolled.append(cid)
        if rolled:
            log.warning("recovery rolled forward checkpoints %s", rolled)
        return rolled
