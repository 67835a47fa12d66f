"""Retention as small composable policies: each names the checkpoints of a run it keeps;
GC deletes what no policy keeps. Spelled in settings as a comma list, e.g.
`latest:3,every:1000,tagged,last-good,branch-heads` (LASTGOOD_RETENTION), the service's
default; a run may carry its own in the same syntax (runs.retention, domain/runs/run_retention.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from lastgood.wire.tiers import DEFAULT_MEMORY_KEEP

from ...catalog.models import LAST_GOOD_DURABLE, SUSPECT


@dataclass
class RunView:
    """What the policies see of one run: committed checkpoints, tags, pointers."""

    last_good_id: int | None
    committed: list[tuple[int, int]]               # (id, step), oldest first
    tags: dict[int, set[str]] = field(default_factory=dict)  # id -> tag names (pins included)
    branch_heads: set[int] = field(default_factory=set)
    memory: set[int] = field(default_factory=set)  # the committed ones of the memory tier


class Policy:
    name = "policy"

    def keep(self, run: RunView) -> set[int]:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name


@dataclass
class KeepLatest(Policy):
    n: int
    name = "latest"

    def keep(self, run):
        return {cid for cid, _ in sorted(run.committed, key=lambda c: (c[1], c[0]))[-self.n:]} if self.n else set()

    def describe(self):
        return f"latest:{self.n}"


@dataclass
class KeepEvery(Policy):
    """The first checkpoint of every `steps`-long window of steps (0..N-1, N..2N-1, ...)."""

    steps: int
    name = "every"

    def keep(self, run):
        first: dict[int, tuple[int, int]] = {}
        for cid, step in run.committed:
            bucket = step // self.steps
            if bucket not in first or (step, cid) < first[bucket]:
                first[bucket] = (step, cid)
        return {cid for _, cid in first.values()}

    def describe(self):
        return f"every:{self.steps}"


class KeepTagged(Policy):
    """Tagged, aliased, pinned, rollback targets; `suspect` alone keeps nothing."""

    name = "tagged"

    def keep(self, run):
        return {cid for cid, names in run.tags.items() if names - {SUSPECT}}


class KeepLastGood(Policy):
    name = "last-good"

    def keep(self, run):
        return {run.last_good_id} if run.last_good_id else set()


class KeepBranchHeads(Policy):
    """The newest committed checkpoint of every branch: what a branch needs to resume."""

    name = "branch-heads"

    def keep(self, run):
        return set(run.branch_heads)


MAX_SPEC = 512  # runs.retention's width


@dataclass
class KeepMemoryLatest(Policy):
    """The newest n memory checkpoints (docs/memory-tier.md); latest:N and every:N count
    durable checkpoints only, and a spec without this rule keeps tiers.DEFAULT_MEMORY_KEEP."""

    n: int
    name = "memory:latest"

    def keep(self, run):
        mem = [c for c in run.committed if c[0] in run.memory]
        return {cid for cid, _ in sorted(mem, key=lambda c: (c[1], c[0]))[-self.n:]} if self.n else set()

    def describe(self):
        return f"memory:latest:{self.n}"


def _durable_only(run: RunView) -> RunView:
    if not run.memory:
        return run
    return RunView(run.last_good_id, [c for c in run.committed if c[0] not in run.memory], run.tags,
                   run.branch_heads, set())


class Retention:
    def __init__(self, policies: list[Policy]) -> None:
        self.policies = policies

    def keep(self, run: RunView) -> set[int]:
        # whatever the policies: the checkpoint a memory checkpoint's restore falls back to
        kept: set[int] = {cid for cid, names in run.tags.items() if LAST_GOOD_DURABLE in names}
        durable = _durable_only(run)
        for p in self.policies:
            kept |= p.keep(durable if isinstance(p, (KeepLatest, KeepEvery)) else run)
        if run.memory and not any(isinstance(p, KeepMemoryLatest) for p in self.policies):
            kept |= KeepMemoryLatest(DEFAULT_MEMORY_KEEP).keep(run)
        return kept

    def describe(self) -> str:
        return ",".join(p.describe() for p in self.policies)

    @classmethod
    def parse(cls, spec: str) -> "Retention":
        if len(spec) > MAX_SPEC:
            raise ValueError(f"retention is {len(spec)} characters; at most {MAX_SPEC}")
        policies: list[Policy] = []
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            name, _, arg = part.partition(":")
            if name == "memory":
                sub, _, n = arg.partition(":")
                if sub != "latest" or not n.isdigit():
                    raise ValueError(f"retention {part!r}: use memory:latest:N, e.g. memory:latest:2")
                policies.append(KeepMemoryLatest(int(n)))
            elif name in ("latest", "every"):
                if not arg.isdigit() or (name == "every" and int(arg) == 0):
                    raise ValueError(f"retention {part!r}: {name} takes a positive number, e.g. {name}:3")
                policies.append(KeepLatest(int(arg)) if name == "latest" else KeepEvery(int(arg)))
            elif name in ("tagged", "last-good", "branch-heads") and not arg:
                policies.append({"tagged": KeepTagged, "last-good": KeepLastGood,
                                 "branch-heads": KeepBranchHeads}[name]())
            else:
                raise ValueError(f"unknown retention policy {part!r}; use latest:N, every:N, tagged, "
                                 f"last-good, branch-heads, memory:latest:N")
        names = {p.name for p in policies}
        if not {"last-good", "branch-heads"} <= names:
            raise ValueError("retention must keep last-good and branch-heads: a run must always be resumable")
        return cls(policies)


@lru_cache(maxsize=1024)
def _parsed(spec: str) -> Retention:
    return Retention.parse(spec)


def effective(run_spec: str | None, default: Retention) -> Retention:
    """The policy GC applies to a run: its own, else the service's default. A run's spec
    was validated when it was set; one that does not parse (a syntax this service does not
    know) falls back to the default, which is never less safe than what it keeps."""
    if not run_spec:
        return default
    try:
        return _parsed(run_spec)
    except ValueError:
        return default
