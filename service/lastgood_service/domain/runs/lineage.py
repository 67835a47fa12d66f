"""A run's lineage: the tree of checkpoints by parent pointer, with branches.

Branches follow one rule (assign_branches): walking checkpoints in creation order, a committed
checkpoint continues its parent's branch if it is the parent's first committed child,
and starts a new branch otherwise (the trainer restored an older checkpoint and saved
again: a rollback or a restart from further back). Pending and abandoned checkpoints
stay on their parent's branch without claiming it, so a retried save after a crash is not
mistaken for a branch. Whether a row claims is whether it was ever committed
(`committed_at`), not its status now: GC turns committed and abandoned checkpoints alike
into DELETED, and only the first kind continued its parent's branch. Each checkpoint's
branch is stored when it is begun or committed (domain/runs/branches.py applies this rule to
the rows a change can affect), so a lineage page reads its own rows, not the whole run.
"""

from __future__ import annotations

import json
from collections import defaultdict

from sqlalchemy import func, select, type_coerce
from sqlalchemy.orm import Session

from ...catalog.models import LAST_GOOD, RAW_UTC, SYSTEM, Checkpoint, Run, RunStats, Tag, Vote, iso_utc


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


# a lineage node's columns, read as plain rows: a page of 1,000 ORM objects costs more
# (identity map, attribute access) than the query itself; its times read raw (RAW_UTC:
# UTCDateTime's Python call a value would be a quarter of the page's CPU)
_NODE_COLUMNS = (Checkpoint.id, Checkpoint.step, Checkpoint.status, Checkpoint.tier, Checkpoint.parent_id, Checkpoint.branch,
                 Checkpoint.bytes, Checkpoint.world_size, Checkpoint.attempt,
                 type_coerce(Checkpoint.created_at, RAW_UTC), type_coerce(Checkpoint.committed_at, RAW_UTC),
                 # its last rank's vote, by the votes' key: half the time of a join grouped by
                 # checkpoint in a second statement (SQLite 8.3 -> 4.0 ms, PostgreSQL 10.7 -> 8.1
                 # a page of 1,000 x 8 ranks), and no dict of them
                 select(func.max(type_coerce(Vote.created_at, RAW_UTC))).where(Vote.checkpoint_id == Checkpoint.id)
                 .scalar_subquery())
# the REST answer's encoder (Starlette's JSONResponse renders with exactly these options):
# the page's text below is built from its pieces, so it is byte for byte what the route
# renders from a dict a node (tests/catalog/test_lineage_answer.py holds that answer)
_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode
_NODE = ('{{"id":{},"step":{},"status":{},"tier":{},"parent_id":{},"branch":{},"tags":{},"bytes":{},"world_size":{},'
         '"attempt":{},"last_good":{},"created_at":"{}","committed_at":{},"save_seconds":{},"commit_seconds":{}}}')
_EDGE = '{{"from":{},"to":{}}}'


def _seconds(a, b):
    return "null" if a is None or b is None else repr(round((b - a).total_seconds(), 6))


def _page_span(s: Session, run: Run, limit: int, offset: int) -> tuple[int, int] | None:
    """The first and last checkpoint id of the page: an index-only range of (run_id, id)."""
    ids = (select(Checkpoint.id).where(Checkpoint.run_id == run.id).order_by(Checkpoint.id)
           .limit(limit).offset(offset).subquery())
    lo, hi = s.execute(select(func.min(ids.c.id), func.max(ids.c.id))).one()
    return None if lo is None else (lo, hi)


def lineage_json(s: Session, run: Run, limit: int, offset: int) -> bytes:
    """One page of the run's lineage in creation order, as the REST answer's JSON text: an
    index range of the run's checkpoints with their stored branches; the total and the
    branch count come from the run's counters and the (run_id, branch) index, so a page
    costs its own rows.

    Why text and not a dict a node: a whole run's page (1,000 nodes) held a row, a node dict
    and an edge dict per node at once, ~3,000 objects that Python's cyclic GC counts: 11
    young collections an answer rendered and a full one every 10-15 answers, the lineage's
    p99 at 100,000 checkpoints (bench/README.md, #20). Rows are read one at a time and each
    becomes one string; what the call holds is strings, which the collector never walks."""
    stats = s.get(RunStats, run.id)
    total = sum(stats.by_status().values()) if stats is not None else 0
    top = s.scalar(select(func.max(Checkpoint.branch)).where(Checkpoint.run_id == run.id))
    good = run.last_good_id
    nodes: list[str] = []
    edges: list[str] = []
    span = _page_span(s, run, limit, offset)
    if span is not None:
        # the page is an id range of the run: its tags are found by that range (no IN list of
        # 1,000 ids), and so are its rows, read one at a time through Core (the ORM's execute
        # fetches all first)
        tags = {cid: _json(t) for cid, t in tags_by_checkpoint(s, run, span=span).items()}
        texts: dict = {}  # statuses and attempts repeat: each encoded once a page
        rows = s.connection().execute(select(*_NODE_COLUMNS)
                                      .where(Checkpoint.run_id == run.id, Checkpoint.id.between(*span))
                                      .order_by(Checkpoint.id).limit(limit))
        for cid, step, status, tier, parent, branch, nbytes, world, attempt, created, committed, voted in rows:
            if (st := texts.get(status)) is None:
                st = texts[status] = _json(status)
            if (tr := texts.get(tier)) is None:
                tr = texts[tier] = _json(tier)
            if (at := texts.get((attempt,))) is None:
                at = texts[(attempt,)] = _json(attempt)
            nodes.append(_NODE.format(
                cid, step, st, tr, "null" if parent is None else parent, branch, tags.get(cid, "[]"), nbytes, world,
                at, "true" if good == cid else "false", iso_utc(created),
                '"%s"' % iso_utc(committed) if committed else "null",
                # save: begin to commit; commit: the last rank's vote to the commit transaction
                _seconds(created, committed), _seconds(voted, committed)))
            if parent is not None:
                edges.append(_EDGE.format(parent, cid))
    head = '{"run":%s,"last_good_id":%s,"nodes":[' % (_json(run.name), "null" if good is None else good)
    tail = '],"branches":%d,"total":%d,"limit":%d,"offset":%d}' % (top + 1 if top is not None else 0, total,
                                                                   limit, offset)
    return "".join((head, ",".join(nodes), '],"edges":[', ",".join(edges), tail)).encode()


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
