"""Stored branches (checkpoints.branch, domain/runs/branches.py) equal the rule's answer over
the whole run (lineage.assign_branches, what the lineage computed on every read before)
after begins, commits in and out of creation order, aborts, rollback-style branches from
older checkpoints, and a lineage page reads them."""

from __future__ import annotations

from sqlalchemy import select

from lastgood_service.catalog.models import Checkpoint, Run
from lastgood_service.domain.runs.lineage import assign_branches
from lastgood_service.domain.queries import Queries

from tests.service.helpers import make_shard, shard_name

from .test_commit_backends import put, save


def stored_and_derived(sessions, run: str) -> tuple[dict[int, int], dict[int, int]]:
    with sessions() as s:
        rows = list(s.execute(select(Checkpoint.id, Checkpoint.parent_id, Checkpoint.committed_at, Checkpoint.branch)
                              .join(Run, Run.id == Checkpoint.run_id).where(Run.name == run)
                              .order_by(Checkpoint.id)))
    return ({r.id: r.branch for r in rows},
            assign_branches([(r.id, r.parent_id, r.committed_at is not None) for r in rows]))


def commit(commits, cid: int, step: int) -> None:
    put(commits, cid, 0, make_shard(0, seed=step % 200))
    assert commits.vote(cid, 0, [shard_name(0)]).status == "COMMITTED"


def test_stored_branches_equal_the_rule_over_the_whole_run(sessions, commits):
    run = "branches"

    def same(phase):
        stored, derived = stored_and_derived(sessions, run)
        assert stored == derived, phase

    a = save(commits, run, 10)
    b = save(commits, run, 20, parent=a)
    same("a chain")
    # two children of b begun, the later one committed first: the earlier takes b's branch
    # back once it commits (the rule walks creation order), the later moves to a new branch
    x = commits.begin(run, 30, 1, b, "x").id
    y = commits.begin(run, 30, 1, b, "y").id
    same("two pending children")
    commit(commits, y, 30)
    same("the later sibling committed first")
    z = commits.begin(run, 40, 1, y, "z").id  # pending on y's branch
    commit(commits, x, 30)
    same("the earlier sibling committed: y and what hangs off it renumber")
    commit(commits, z, 40)
    same("a pending child of the renumbered sibling committed")
    # a branch from an older checkpoint (a rollback's restart), an abort, a second root
    c = save(commits, run, 20, parent=a, attempt="restart")
    aborted = commits.begin(run, 50, 1, c, "gone").id
    commits.abort(aborted)
    save(commits, run, 5, attempt="again")
    save(commits, run, 30, parent=c, attempt="restart")
    same("branches, an abort, a second root")
    stored, _ = stored_and_derived(sessions, run)
    assert len(set(stored.values())) >= 4  # the workload made branches at all

    page = Queries(sessions).lineage(run, limit=3, offset=2)
    assert [n["branch"] for n in page["nodes"]] == [stored[n["id"]] for n in page["nodes"]]
    assert page["total"] == len(stored) and page["branches"] == max(stored.values()) + 1
