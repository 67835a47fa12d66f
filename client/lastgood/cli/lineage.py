"""The shape of `lastgood lineage`: a run's checkpoints as branches, collapsible.

A run is mostly one long chain, so drawing each checkpoint as the child of its parent
would indent a thousand levels deep. Instead each *branch* (the service numbers them:
a committed checkpoint that is not its parent's first committed child starts one) is a
flat list in id order, and a branch that forks off checkpoint #N hangs under #N.

Collapsing keeps the structure: with more checkpoints than `max_nodes`, the first and
last checkpoint of every branch, every fork point and last-good are always shown; then
tagged or corrupt ones, then the newest, up to the budget. Hidden checkpoints between
shown ones become one gap line each.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from lastgood.wire.names import LAST_GOOD_TAG
from lastgood.wire.vocab import Status


@dataclass
class Gap:
    nodes: list[dict]  # the hidden checkpoints, in id order

    @property
    def count(self) -> int:
        return len(self.nodes)


@dataclass
class Branch:
    number: int
    fork: int | None                                    # the checkpoint it forks from; None for a root branch
    nodes: list[dict] = field(default_factory=list)     # every checkpoint of the branch, id order
    items: list[dict | Gap] = field(default_factory=list)  # what is drawn: checkpoints and gaps


@dataclass
class View:
    roots: list[Branch]                   # branches that fork from nothing in the run
    forks: dict[int, list[Branch]]        # checkpoint id -> branches forking off it
    shown: int
    total: int


def _interesting(node: dict) -> bool:
    return node["status"] == Status.CORRUPT or any(t["name"] != LAST_GOOD_TAG for t in node.get("tags", ()))


def build(nodes: list[dict], max_nodes: int = 0) -> View:
    by_id = {n["id"]: n for n in nodes}
    groups: dict[int, list[dict]] = defaultdict(list)
    for n in sorted(nodes, key=lambda n: n["id"]):
        groups[n["branch"]].append(n)
    branches: list[Branch] = []
    for number, members in sorted(groups.items(), key=lambda kv: kv[1][0]["id"]):
        parent = members[0]["parent_id"]
        fork = parent if parent in by_id and by_id[parent]["branch"] != number else None
        branches.append(Branch(number, fork, members))

    if max_nodes <= 0 or len(nodes) <= max_nodes:
        visible = set(by_id)
    else:
        visible = {b.nodes[0]["id"] for b in branches} | {b.nodes[-1]["id"] for b in branches}
        visible |= {b.fork for b in branches if b.fork is not None}
        visible |= {n["id"] for n in nodes if n.get("last_good")}
        newest_first = sorted(nodes, key=lambda n: n["id"], reverse=True)
        for n in [n for n in newest_first if _interesting(n)] + newest_first:
            if len(visible) >= max_nodes:
                break
            visible.add(n["id"])

    view = View([], defaultdict(list), 0, len(nodes))
    for b in branches:
        for n in b.nodes:
            if n["id"] in visible:
                b.items.append(n)
                view.shown += 1
            elif b.items and isinstance(b.items[-1], Gap):
                b.items[-1].nodes.append(n)
            else:
                b.items.append(Gap([n]))
        (view.forks[b.fork] if b.fork is not None else view.roots).append(b)
    return view
