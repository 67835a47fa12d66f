"""A lineage page's answer, rendered straight to JSON text (domain/runs/lineage.py), is byte for
byte what the page's dict of nodes rendered by the REST route's encoder was, on SQLite and
PostgreSQL: seeded runs (GC done and not), branches, an abort, a pending save, tags with
quotes and non-ASCII names, a timestamp without microseconds, pages at every offset. And a
whole run's answer does not make Python's cyclic GC run per node (bench/README.md, #20)."""

from __future__ import annotations

import datetime as dt
import gc
import json
from collections import defaultdict

from sqlalchemy import func, insert, select, update

from bench.seed import seed
from lastgood_service.catalog.models import LAST_GOOD, SYSTEM, Checkpoint, Run, RunStats, Tag, Vote
from lastgood_service.domain.queries import MAX_LINEAGE, Queries

from .test_commit_backends import save


def reference_answer(s, run_name: str, limit: int, offset: int) -> bytes:
    """The answer as the starting commit built it: a dict a node, rendered by Starlette's
    JSONResponse (the route's encoder then): the oracle the rendered text must equal."""
    run = s.scalar(select(Run).where(Run.name == run_name))
    stats = s.get(RunStats, run.id)
    total = sum(stats.by_status().values()) if stats is not None else 0
    top = s.scalar(select(func.max(Checkpoint.branch)).where(Checkpoint.run_id == run.id))
    page = s.execute(select(Checkpoint.id, Checkpoint.step, Checkpoint.status, Checkpoint.tier, Checkpoint.parent_id,
                            Checkpoint.branch, Checkpoint.bytes, Checkpoint.world_size, Checkpoint.attempt,
                            Checkpoint.created_at, Checkpoint.committed_at)
                     .where(Checkpoint.run_id == run.id).order_by(Checkpoint.id).limit(limit).offset(offset)).all()
    last_votes = dict(s.execute(select(Vote.checkpoint_id, func.max(Vote.created_at)).group_by(Vote.checkpoint_id)).all())
    tags: dict = defaultdict(list)
    for cid, name, kind in s.execute(select(Tag.checkpoint_id, Tag.name, Tag.kind).where(Tag.run_id == run.id)
                                     .order_by(Tag.id)):
        tags[cid].append({"name": name, "kind": kind})
    good = run.last_good_id
    if good is not None:
        tags[good].insert(0, {"name": LAST_GOOD, "kind": SYSTEM})

    def seconds(a, b):
        return None if a is None or b is None else round((b - a).total_seconds(), 6)

    nodes, edges = [], []
    for cid, step, status, tier, parent, branch, nbytes, world, attempt, created, committed in page:
        nodes.append({
            "id": cid, "step": step, "status": status, "tier": tier, "parent_id": parent, "branch": branch,
            "tags": tags.get(cid, []), "bytes": nbytes, "world_size": world, "attempt": attempt,
            "last_good": good == cid,
            "created_at": created.isoformat(), "committed_at": committed.isoformat() if committed else None,
            "save_seconds": seconds(created, committed), "commit_seconds": seconds(last_votes.get(cid), committed),
        })
        if parent is not None:
            edges.append({"from": parent, "to": cid})
    doc = {"run": run.name, "last_good_id": good, "nodes": nodes, "edges": edges,
           "branches": top + 1 if top is not None else 0, "total": total, "limit": limit, "offset": offset}
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def test_the_rendered_answer_equals_the_dict_of_nodes_rendered(catalog_url, sessions, commits, clock):
    seed(catalog_url, runs=2, checkpoints=40, ranks=2, keep=3, migrate=False, prefix="ans")
    seed(catalog_url, runs=1, checkpoints=40, ranks=2, gc_done=False, migrate=False, prefix="behind")
    run = "mixed"
    a = save(commits, run, 10)
    b = save(commits, run, 20, parent=a, world=2)
    save(commits, run, 30, parent=b)
    c = save(commits, run, 20, parent=a, attempt="redo")  # a branch from an older checkpoint
    gone = commits.begin(run, 40, 1, c, "gone").id
    commits.abort(gone)
    clock.advance(7.25)
    d = save(commits, run, 50, parent=c, attempt="q.uote:x")
    commits.begin(run, 60, 2, d, "pending")  # a save in progress: no committed_at, no votes
    with sessions() as s, s.begin():
        run_id = s.scalar(select(Run.id).where(Run.name == run))
        now = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
        # a timestamp without microseconds (isoformat leaves them out), committed a whole second later
        s.execute(update(Checkpoint).where(Checkpoint.id == b).values(created_at=now,
                                                                       committed_at=now + dt.timedelta(seconds=1)))
        s.execute(insert(Tag), [{"run_id": run_id, "checkpoint_id": cid, "name": name, "kind": kind, "created_at": now}
                                for cid, name, kind in ((a, "best", "tag"), (a, "prod ✓", "alias"),
                                                        (c, '<b>"x"</b>\\', "tag"), (d, "pinned", "pin"))])
    with sessions() as s:
        runs = ["ans-00001", "behind-00003", run]
        expected = {(r, lim, off): reference_answer(s, r, lim, off) for r in runs
                    for lim, off in ((MAX_LINEAGE, 0), (1000, 0), (7, 0), (7, 5), (3, 36), (5, 1000))}
    q = Queries(sessions)
    for (r, lim, off), want in expected.items():
        assert q.lineage_json(r, lim, off) == want, (r, lim, off)
    assert b'"tags":[{"name":"last-good","kind":"system"}' in expected[(run, MAX_LINEAGE, 0)]  # the cases are there
    assert "prod ✓".encode() in expected[(run, MAX_LINEAGE, 0)]


def collections_during(fn) -> int:
    """Generation-0 collections while fn runs, at CPython's default threshold (700 net new
    container objects each): a measure of the Python objects a call keeps alive at once."""
    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(700, 10, 10)
    try:
        before = gc.get_stats()[0]["collections"]
        fn()
        return gc.get_stats()[0]["collections"] - before
    finally:
        gc.set_threshold(*old)


def test_a_whole_runs_answer_keeps_no_python_object_a_node(catalog_url, sessions):
    """1,000 nodes: the dict a node (and a row, an edge dict) held at once made ~5-7
    collections a call, and every 100 of them a full one; the rendered text holds strings."""
    seed(catalog_url, runs=1, checkpoints=1000, ranks=2, keep=3, migrate=False, prefix="big")
    q = Queries(sessions)
    q.lineage_json("big-00001", MAX_LINEAGE)  # statements compiled and cached
    assert collections_during(lambda: q.lineage_json("big-00001", MAX_LINEAGE)) <= 1
    # CONTROL: holding a dict a node, as the answer was built before, is seen
    assert collections_during(lambda: [{"id": i, "tags": []} for i in range(1000)]) >= 1
