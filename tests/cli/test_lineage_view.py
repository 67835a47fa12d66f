"""How `lineage` lays out and collapses a large tree (lastgood.cli.lineage.build, a pure
function over the nodes the service returns; the rendering is tested in test_read.py)."""

from __future__ import annotations

from lastgood.cli.lineage import Gap, build


def node(cid, parent, branch, status="COMMITTED", tags=(), last_good=False):
    return {"id": cid, "parent_id": parent, "branch": branch, "step": cid * 10, "status": status,
            "tags": [{"name": t, "kind": "tag"} for t in tags], "last_good": last_good}


def chain_with_fork(n: int = 1000, fork_at: int = 400):
    """1..n on branch 0; a branch 1 of three checkpoints forking off `fork_at`; last-good at its end."""
    nodes = [node(i, i - 1 if i > 1 else None, 0) for i in range(1, n + 1)]
    if n >= 500:
        nodes[499]["tags"] = [{"name": "best", "kind": "tag"}]
    nodes += [node(n + 1, fork_at, 1), node(n + 2, n + 1, 1), node(n + 3, n + 2, 1, last_good=True)]
    return nodes


def test_everything_shown_within_the_budget():
    nodes = chain_with_fork(20, fork_at=5)
    view = build(nodes, max_nodes=0)
    assert view.shown == view.total == 23
    (root,) = view.roots
    assert root.number == 0 and root.fork is None and [n["id"] for n in root.items] == list(range(1, 21))
    (branch,) = view.forks[5]
    assert branch.number == 1 and branch.fork == 5 and [n["id"] for n in branch.items] == [21, 22, 23]
    assert build(nodes, max_nodes=23).shown == 23


def test_collapsing_keeps_structure_and_accounts_for_every_checkpoint():
    nodes = chain_with_fork()
    view = build(nodes, max_nodes=20)
    assert view.total == 1003 and view.shown == 20
    (root,) = view.roots
    shown = [i["id"] for i in root.items if not isinstance(i, Gap)]
    for must in (1, 1000, 400, 500):  # first, last, the fork point, the tagged one
        assert must in shown
    (branch,) = view.forks[400]
    assert [i["id"] for i in branch.items] == [1001, 1002, 1003]  # the newest, and last-good
    # gaps and shown checkpoints together are the branch, in order, with no two gaps adjacent
    flat = []
    for a, b in zip(root.items, root.items[1:]):
        assert not (isinstance(a, Gap) and isinstance(b, Gap))
    for item in root.items:
        flat += [n["id"] for n in item.nodes] if isinstance(item, Gap) else [item["id"]]
    assert flat == list(range(1, 1001))


def test_structure_wins_over_a_tiny_budget():
    nodes = chain_with_fork()
    view = build(nodes, max_nodes=1)
    # branch starts and ends, the fork point and last-good are always drawn
    assert view.shown == 5
    assert {i["id"] for i in view.roots[0].items if not isinstance(i, Gap)} == {1, 400, 1000}


def test_second_root_and_orphaned_parent_are_roots():
    nodes = [node(1, None, 0), node(2, 1, 0), node(3, None, 1), node(4, 99, 2)]  # 99: not in the page
    view = build(nodes)
    assert [(b.number, b.fork) for b in view.roots] == [(0, None), (1, None), (2, None)]
    assert not view.forks
