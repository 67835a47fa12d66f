"""Last-good: the one owner of a run's `last_good_id` pointer (I3, docs/architecture.md).

The pointer is the newest complete, usable checkpoint on the branch the run is writing
to. It has exactly three moves, and every writer calls one of them inside its own
transaction, never assigns the pointer itself:

  advance          a commit (or a rebuilt commit) may become last-good
  retreat          a checkpoint found CORRUPT gives it up to its usable ancestor
  roll_back_to     a rollback after a loss spike takes it back to the target

Beside it, `move_durable_tag` keeps the run's newest committed durable checkpoint under the
system tag last-good-durable (docs/memory-tier.md), in every durable commit's transaction.

`usable_ancestor` is the fall-back rule both a retreat and a restore that cannot use a
checkpoint (GET /checkpoints/{id}/ancestors, `fallback_id`) follow; the client asks the
service for it and keeps no copy.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from ...catalog.models import COMMITTED, DURABLE, LAST_GOOD_DURABLE, SUSPECT, SYSTEM, Checkpoint, Run, Tag, utcnow
from .lineage import ancestors


def advance(s: Session, ck: Checkpoint) -> bool:
    """ck was just committed: it becomes last-good if it is a newer step than the current
    one, or if it was begun after the current one committed (the trainer restored an older
    checkpoint on purpose and branched from it). A commit that continues a suspect
    checkpoint (saved inside a loss-spike window) is suspect too, never last-good.
    True if the pointer moved."""
    run = s.get(Run, ck.run_id, with_for_update=True)  # two commits of one run: no lost update
    if ck.parent_id is not None and s.scalar(
            select(Tag.id).where(Tag.checkpoint_id == ck.parent_id, Tag.name == SUSPECT).limit(1)):
        s.add(Tag(run_id=run.id, checkpoint_id=ck.id, name=SUSPECT, kind=SYSTEM, created_at=utcnow()))
        return False
    cur = s.get(Checkpoint, run.last_good_id) if run.last_good_id else None
    if cur is None or ck.step > cur.step or (cur.committed_at is not None and ck.created_at > cur.committed_at):
        run.last_good_id = ck.id
        return True
    return False


def retreat(s: Session, ck: Checkpoint) -> int | None:
    """ck was found CORRUPT: if it was last-good, last-good falls back along its parent
    chain, never to another branch. The run's last-good id afterwards."""
    run = s.get(Run, ck.run_id, with_for_update=True)
    if run.last_good_id == ck.id:
        run.last_good_id = usable_ancestor(s, ck)
    return run.last_good_id


def roll_back_to(run: Run, target: Checkpoint, suspects: list[int]) -> int | None:
    """A rollback made `suspects` suspect: last-good moves back to the target if it was one
    of them (or the run had none). The caller holds the run's row lock. The run's
    last-good id afterwards."""
    if run.last_good_id is None or run.last_good_id in suspects:
        run.last_good_id = target.id
    return run.last_good_id


def usable_ancestor(s: Session, ck: Checkpoint) -> int | None:
    """The newest committed, non-suspect checkpoint up ck's parent chain (never one of an
    abandoned branch), or None. The one rule for "fall back from a damaged checkpoint":
    last-good retreats there when ck is marked CORRUPT, and a restore that cannot use ck
    asks for it (GET /checkpoints/{id}/ancestors, `fallback_id`)."""
    suspect = set(s.scalars(select(Tag.checkpoint_id).where(Tag.run_id == ck.run_id, Tag.name == SUSPECT)))
    status = dict(s.execute(select(Checkpoint.id, Checkpoint.status).where(Checkpoint.run_id == ck.run_id)).all())
    for cid in ancestors(s, ck):
        if status.get(cid) == COMMITTED and cid not in suspect:
            return cid
    return None


def move_durable_tag(s: Session, ck: Checkpoint) -> None:
    """ck was just committed. In a run with memory checkpoints, the system tag
    LAST_GOOD_DURABLE (lastgood.wire.tiers) names the run's newest committed durable
    checkpoint, moved in the commit's transaction: by a durable commit to itself, by a
    memory commit (the run's first) to the newest durable one if it names none yet. GC never
    deletes the checkpoint it names (retention.Retention.keep), so a restore whose memory
    copies are lost has it. A run of durable checkpoints only has no such tag (last-good is it)."""
    cur = s.scalar(select(Tag).where(Tag.run_id == ck.run_id, Tag.name == LAST_GOOD_DURABLE, Tag.kind == SYSTEM))
    if ck.tier == DURABLE:
        if cur is None and s.scalar(select(Checkpoint.id).where(Checkpoint.run_id == ck.run_id,
                                                                Checkpoint.tier != DURABLE).limit(1)) is None:
            return
        target = ck
    else:
        if cur is not None:
            return
        target = s.scalar(select(Checkpoint).where(Checkpoint.run_id == ck.run_id, Checkpoint.tier == DURABLE,
                                                   Checkpoint.status == COMMITTED)
                          .order_by(Checkpoint.step.desc(), Checkpoint.id.desc()).limit(1))
        if target is None:
            return
    if cur is not None:
        held = s.get(Checkpoint, cur.checkpoint_id)
        if held is not None and held.status == COMMITTED and held.step > target.step:
            return
        cur.checkpoint_id, cur.created_at = target.id, utcnow()
    else:
        s.add(Tag(run_id=ck.run_id, checkpoint_id=target.id, name=LAST_GOOD_DURABLE, kind=SYSTEM,
                  created_at=utcnow()))
