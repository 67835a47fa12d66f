"""A run's lineage: the tree of checkpoints by parent pointer, with branches.

Branches follow one rule (assign_branches): walking checkpoints in creation order, a committed
checkpoint continues its parent's branch if it is the parent's first committed child,
and starts a new branch otherwise (the trainer restored an older checkpoint and saved
again: a rollback or a restart from further back). Pending and abandoned checkpoints
stay on their parent's branch without claiming it, so a retried save after a crash is not
mistaken for a branch. Whether a row claims is whether it was ever committed
(`committed_at`), not its status now: GC turns committed and abandoned checkpoints alike
into DELETED, and only the first kind continued its parent's branch. Each checkpoint's
branch is stored when it is begun or committed (domain/branches.py applies this rule to
the rows a change can affect), so a lineage page reads its own rows, not the whole run.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..catalog.models import LAST_GOOD, SYSTEM, Checkpoint, Run, RunStats, Tag, Vote


def assign_branches(rows: list[tuple[int, int | None, bool]], branch: dict[int | None, int] | None = None,
                    claimed: set[int | None] | None = None, next_branch: int = 1) -> dict[int, int]:
    """rows: (id, parent_id, was_committed) in creation order -> id -> branch number (0 first).
    Roots hang off one virtual root (None), so a second committed root is a branch too.
    `branch`, `claimed`, `next_branch`: the state after the rows before these (domain/
    branches.py continues a run from the middle); by default the run's start."""
    branch = {None: 0} if branch is None else {None: 0, **branch}
    claimed = set() if claimed is None else claimed  # parents whose branch a committed child continued
    for cid, parent, was_committed in rows:
        parent = parent if parent in branch else None
        if not was_committed:
            branch[cid] = branch[parent]
        elif parent not in claimed:
            claimed.add(parent)
            branch[cid] = branch[parent]
        else:
            branch[cid], next_branch = next_branch, next_branch + 1
    del branch[None]
    return branch  # type: ignore[return-value]


def tags_by_checkpoint(s: Session, run: Run, ids: list[int] | None = None,
                       span: tuple[int, int] | None = None) -> dict[int, list[dict]]:
    """`ids`: only these checkpoints' tags; `span`: only those of checkpoints with ids in
    [lo, hi] (a lineage page: one range, not an IN list of its 1,000 ids)."""
    q = select(Tag.checkpoint_id, Tag.name, Tag.kind).where(Tag.run_id == run.id)
    if ids is not None:
        q = q.where(Tag.checkpoint_id.in_(ids))
    if span is not None:
        q = q.where(Tag.checkpoint_id.between(*span))
    out: dict[int, list[dict]] = defaultdict(list)
    for cid, name, kind in s.execute(q.order_by(Tag.id)):
        out[cid].append({"name": name, "kind": kind})
    good = run.last_good_id
    if good is not None and (ids is None or good in ids) and (span is None or span[0] <= good <= span[1]):
        out[good].insert(0, {"name": LAST_GOOD, "kind": SYSTEM})
    return out


# a lineage node's columns, read as plain rows: a page of 1,000 ORM objects cost more
# (identity map, attribute access) than the query itself
_NODE_COLUMNS = (Checkpoint.id, Checkpoint.step, Checkpoint.status, Checkpoint.parent_id, Checkpoint.branch,
                 Checkpoint.bytes, Checkpoint.world_size, Checkpoint.attempt, Checkpoint.created_at,
                 Checkpoint.committed_at)
_NO_TAGS: list = []  # shared by every untagged node: the answer is serialized, never changed


def _seconds(a, b):
    return None if a is None or b is None else round((b - a).total_seconds(), 6)


def lineage(s: Session, run: Run, limit: int, offset: int) -> dict:
    """One page of the run's lineage in creation order: an index range of the run's
    checkpoints with their stored branches; the total and the branch count come from the
    run's counters and the (run_id, branch) index, so a page costs its own rows."""
    stats = s.get(RunStats, run.id)
    total = sum(stats.by_status().values()) if stats is not None else 0
    top = s.scalar(select(func.max(Checkpoint.branch)).where(Checkpoint.run_id == run.id))
    page = s.execute(select(*_NODE_COLUMNS).where(Checkpoint.run_id == run.id)
                     .order_by(Checkpoint.id).limit(limit).offset(offset)).all()
    last_votes: dict = {}
    tags: dict = {}
    if page:
        # the page is an id range of the run: its votes found from the run's (run_id, id)
        # index range, each checkpoint's by the votes' key (no IN list of 1,000 ids; not a
        # range of votes' ids, which holds every run's checkpoints saved meanwhile)
        lo, hi = page[0][0], page[-1][0]
        last_votes = dict(s.execute(
            select(Checkpoint.id, func.max(Vote.created_at))
            .join(Vote, Vote.checkpoint_id == Checkpoint.id)
            .where(Checkpoint.run_id == run.id, Checkpoint.id.between(lo, hi))
            .group_by(Checkpoint.id)).all())
        tags = tags_by_checkpoint(s, run, span=(lo, hi))
    good = run.last_good_id
    nodes, edges = [], []
    for cid, step, status, parent, branch, nbytes, world, attempt, created, committed in page:
        nodes.append({
            "id": cid, "step": step, "status": status, "parent_id": parent, "branch": branch,
            "tags": tags.get(cid, _NO_TAGS), "bytes": nbytes, "world_size": world, "attempt": attempt,
            "last_good": good == cid,
            "created_at": created.isoformat(), "committed_at": committed.isoformat() if committed else None,
            # save: begin to commit; commit: the last rank's vote to the commit transaction
            "save_seconds": _seconds(created, committed),
            "commit_seconds": _seconds(last_votes.get(cid), committed),
        })
        if parent is not None:
            edges.append({"from": parent, "to": cid})
    return {"run": run.name, "last_good_id": good, "nodes": nodes, "edges": edges,
            "branches": top + 1 if top is not None else 0, "total": total,
            "limit": limit, "offset": offset}


def parents_of(s: Session, run_id: int) -> dict[int, int | None]:
    return dict(s.execute(select(Checkpoint.id, Checkpoint.parent_id).where(Checkpoint.run_id == run_id)).all())


def ancestors(s: Session, ck: Checkpoint) -> list[int]:
    """ck's parent, grandparent, ... up to the root (one query, walked in memory)."""
    parent = parents_of(s, ck.run_id)
    out, cur, seen = [], parent.get(ck.id), {ck.id}
    while cur is not None and cur not in seen:
        out.append(cur)
        seen.add(cur)
        cur = parent.get(cur)
    return out


def descendants(s: Session, root_id: int, run_id: int) -> set[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for cid, parent in parents_of(s, run_id).items():
        if parent is not None:
            children[parent].append(cid)
    out, stack = set(), [root_id]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out
