"""Stored branches: each checkpoint's branch number (`checkpoints.branch`), written when
it is begun, committed or rebuilt, so a lineage page reads an index range instead of
walking the whole run to derive them (domain/runs/lineage.py).

The rule is lineage.assign_branches, the one owner: walking a run in creation order, a
checkpoint's branch depends only on the rows before it. A commit can change the answer
of its own row and of rows after it (a later sibling that committed first loses the
parent's branch to it; new branches after it are numbered one higher), never of rows
before it. So `settle(s, run, from_id)` recomputes the run's suffix from `from_id`, with
what it needs of the prefix read through indexes: the parents' branches, which of them a
committed child already claimed, and the highest branch number so far. A commit settles
from its own row: the suffix is the row and whatever began after it (usually nothing).
A begin needs no settle (`of_begun`): a row not committed takes its parent's branch and
changes no other row's, before or after it.

Callers hold the run's row lock, so two settles of one run never interleave: a begin
holds it shared, a commit exclusively (domain/commit/protocol.py); on SQLite every writer
is serialized anyway.
"""

from __future__ import annotations

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from ...catalog.models import Checkpoint
from .lineage import assign_branches


def of_begun(parent: Checkpoint | None) -> int:
    """The branch of a checkpoint being begun (not committed): its parent's, or the run's
    first for a root (assign_branches's rule for a row not committed, with the parent's
    stored branch). A begin thus writes its row's branch with the row, without reading the
    run's suffix (5 queries, ~1.3 ms of a tiny save's begin: docs/performance.md)."""
    parent_id = None if parent is None else parent.id
    return assign_branches([(0, parent_id, False)], {} if parent is None else {parent.id: parent.branch})[0]


def settle(s: Session, run_id: int, from_id: int) -> int:
    """Store the branch of every checkpoint of the run from `from_id` on; returns how many
    rows changed. Call after the change that moved it (a begin's insert, a commit's update)."""
    ck = Checkpoint
    suffix = list(s.execute(select(ck.id, ck.parent_id, ck.committed_at.is_not(None), ck.branch)
                            .where(ck.run_id == run_id, ck.id >= from_id).order_by(ck.id)))
    if not suffix:
        return 0
    outside = sorted({p for _, p, _, _ in suffix if p is not None and p < from_id})
    branch: dict[int | None, int] = {None: 0}
    claimed: set[int | None] = set()
    if outside:
        branch.update(s.execute(select(ck.id, ck.branch).where(ck.run_id == run_id, ck.id.in_(outside))).all())
        claimed.update(s.scalars(select(ck.parent_id).where(ck.run_id == run_id, ck.parent_id.in_(outside),
                                                            ck.id < from_id, ck.committed_at.is_not(None))))
    if s.scalar(select(ck.id).where(ck.run_id == run_id, ck.parent_id.is_(None), ck.id < from_id,
                                    ck.committed_at.is_not(None)).limit(1)) is not None:
        claimed.add(None)
    top = s.scalar(select(ck.branch).where(ck.run_id == run_id, ck.id < from_id)
                   .order_by(ck.branch.desc()).limit(1))
    assigned = assign_branches([(cid, parent, committed) for cid, parent, committed, _ in suffix],
                               branch, claimed, (top or 0) + 1)
    changed = [{"cid": cid, "b": assigned[cid]} for cid, _, _, stored in suffix if assigned[cid] != stored]
    if changed:  # one executemany, through the Core table (not an ORM bulk update)
        t = ck.__table__
        s.connection().execute(update(t).where(t.c.id == bindparam("cid")).values(branch=bindparam("b")), changed)
    return len(changed)
