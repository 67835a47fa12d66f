"""Garbage collection: `plan()` lists what would go and the bytes freed; `execute(plan)`
deletes at most that, re-checking each checkpoint under a row lock first.

What may go: committed checkpoints no retention policy keeps; CORRUPT and ABANDONED
checkpoints older than the grace period; blobs of checkpoints already DELETED (left by a
crash between the catalog update and the blob deletion). Never (I4): a PENDING
checkpoint, anything a committed manifest that is kept, a tag, a pin or a live read lease
still needs. The catalog row stays, with status DELETED, so the lineage keeps its shape.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from ..blobstore import BlobStore
from ..catalog.models import (ABANDONED, COMMITTED, CORRUPT, DELETED, PENDING, Checkpoint, ReadLease, Run, Tag,
                              utcnow)
from ..metrics import Metrics
from . import keys
from .events import add_event
from .faults import Ballast, is_disk_full
from .gate import CatalogGate
from .lineage import assign_branches
from .retention import Retention, RunView

log = logging.getLogger("lastgood.gc")


@dataclass
class PlannedDeletion:
    checkpoint_id: int
    run: str
    step: int
    status: str
    reason: str
    keys: list[str]
    bytes: int


@dataclass
class Plan:
    policy: str
    checkpoints: list[PlannedDeletion] = field(default_factory=list)
    orphans: list[tuple[str, int]] = field(default_factory=list)  # (key, bytes) of DELETED checkpoints
    unknown: list[str] = field(default_factory=list)     # blobs lastgood cannot place: left alone

    @property
    def bytes_freed(self) -> int:
        return sum(d.bytes for d in self.checkpoints) + sum(n for _, n in self.orphans)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "checkpoints": [asdict(d) for d in self.checkpoints],
                "orphans": [{"key": k, "bytes": n} for k, n in self.orphans], "unknown": self.unknown, "bytes_freed": self.bytes_freed}


class GarbageCollector:
    def __init__(self, sessions: sessionmaker[Session], blobs: BlobStore, retention: Retention,
                 grace_seconds: float, clock: Callable[[], dt.datetime] = utcnow, metrics: Metrics | None = None,
                 gate: CatalogGate | None = None, ballast: Ballast | None = None) -> None:
        self.sessions = sessions
        self.ballast = ballast or Ballast(None, 0)
        self.gate = gate or CatalogGate()  # closed: the blobs of lost commits look deletable
        self.blobs = blobs
        self.retention = retention
        self.grace = dt.timedelta(seconds=grace_seconds)
        self.clock = clock
        self.metrics = metrics or Metrics()  # a private registry when the caller keeps none

    # ---------------------------------------------------------------- decisions
    def _run_view(self, s: Session, run: Run) -> RunView:
        rows = list(s.execute(select(Checkpoint.id, Checkpoint.parent_id, Checkpoint.status, Checkpoint.step,
                                     Checkpoint.committed_at)
                              .where(Checkpoint.run_id == run.id).order_by(Checkpoint.id)))
        branches = assign_branches([(r.id, r.parent_id, r.committed_at is not None) for r in rows])
        heads: dict[int, tuple[int, int]] = {}
        for r in rows:
            if r.status == COMMITTED:
                b = branches[r.id]
                heads[b] = max(heads.get(b, (r.step, r.id)), (r.step, r.id))
        tags: dict[int, set[str]] = defaultdict(set)
        for cid, name in s.execute(select(Tag.checkpoint_id, Tag.name).where(Tag.run_id == run.id)):
            tags[cid].add(name)
        return RunView(run.last_good_id, [(r.id, r.step) for r in rows if r.status == COMMITTED], dict(tags),
                       {cid for _, cid in heads.values()})

    def _why_deletable(self, s: Session, ck: Checkpoint, kept: set[int], now: dt.datetime) -> str | None:
        if ck.status == PENDING or ck.status == DELETED:
            return None
        if s.scalar(select(func.count()).select_from(ReadLease).where(
                ReadLease.checkpoint_id == ck.id, ReadLease.expires_at > now)):
            return None
        if ck.status == COMMITTED:
            return None if ck.id in kept else "not kept by the retention policy"
        if s.scalar(select(Tag.id).where(Tag.checkpoint_id == ck.id, Tag.kind.in_(("tag", "alias", "pin"))).limit(1)):
            return None  # a user tagged or pinned it, even if corrupt
        since = ck.committed_at or ck.lease_expires_at or ck.created_at
        if ck.status in (ABANDONED, CORRUPT) and since + self.grace < now:
            return f"{ck.status.lower()} for longer than the grace period"
        return None

    # ---------------------------------------------------------------- plan / execute
    def plan(self) -> Plan:
        self.gate.check()
        now = self.clock()
        plan = Plan(self.retention.describe())
        stored = [(keys.parse(info.key), info) for info in self.blobs.list(keys.ROOT)]
        plan.unknown += [info.key for parsed, info in stored if parsed is None]
        with self.sessions() as s, s.begin():
            owners = self._owners(s)
            blobs_by_ckpt: dict[int, list[tuple[str, int]]] = defaultdict(list)
            for parsed, info in stored:
                if parsed is None:
                    continue
                if self._owned(parsed, owners):
                    blobs_by_ckpt[parsed.checkpoint_id].append((info.key, info.size))
                else:  # an id this catalog does not know, or another catalog history's: left alone
                    plan.unknown.append(info.key)
            for run in s.scalars(select(Run).order_by(Run.name)):
                kept = self.retention.keep(self._run_view(s, run))
                for ck in s.scalars(select(Checkpoint).where(Checkpoint.run_id == run.id).order_by(Checkpoint.id)):
                    reason = self._why_deletable(s, ck, kept, now)
                    if reason:
                        found = blobs_by_ckpt.get(ck.id, [])
                        plan.checkpoints.append(PlannedDeletion(ck.id, run.name, ck.step, ck.status, reason,
                                                                [k for k, _ in found], sum(n for _, n in found)))
        for cid, found in sorted(blobs_by_ckpt.items()):
            if owners[cid][3] == DELETED:
                plan.orphans += found
        return plan

    def _mark_deleted(self, d: PlannedDeletion, now: dt.datetime) -> bool:
        """Re-check one planned deletion under a row lock and record it; False: skip it."""
        with self.sessions() as s, s.begin():
            ck = s.scalar(select(Checkpoint).where(Checkpoint.id == d.checkpoint_id).with_for_update())
            run = s.get(Run, ck.run_id) if ck else None
            kept = self.retention.keep(self._run_view(s, run)) if run else set()
            if not (ck is not None and ck.status == d.status and self._why_deletable(s, ck, kept, now)):
                return False
            ck.status, ck.deleted_at = DELETED, now
            add_event(s, "gc_delete", ck.run_id, ck.id, step=ck.step, reason=d.reason, bytes=d.bytes,
                      was=d.status)
            return True

    @staticmethod
    def _owners(s: Session) -> dict[int, tuple[str, int, str, str]]:
        """checkpoint id -> (run, step, attempt, status), for placing blobs by their keys."""
        return {cid: (run, step, attempt, status) for cid, run, step, attempt, status in s.execute(
            select(Checkpoint.id, Run.name, Checkpoint.step, Checkpoint.attempt, Checkpoint.status)
            .join(Run, Run.id == Checkpoint.run_id))}

    @staticmethod
    def _owned(parsed: keys.ParsedKey, owners: dict) -> bool:
        owner = owners.get(parsed.checkpoint_id)
        return owner is not None and keys.belongs_to(parsed, parsed.checkpoint_id, *owner[:3])

    def execute(self, plan: Plan) -> dict:
        """Delete what the plan lists, and nothing else; skip whatever is no longer deletable."""
        self.gate.check()
        deleted, skipped, freed = [], [], 0
        now = self.clock()
        released = False
        for d in plan.checkpoints:
            try:
                marked = self._mark_deleted(d, now)
            except Exception as e:
                if not is_disk_full(e) or not self.ballast.release():
                    raise
                released = True  # the catalog could not write at all: give it the ballast's room
                marked = self._mark_deleted(d, now)
            if not marked:
                skipped.append(d.checkpoint_id)
                continue
            for key in d.keys:  # only after the catalog says DELETED: a crash leaves orphans, never holes
                self.blobs.delete(key)
            deleted.append(d.checkpoint_id)
            freed += d.bytes
        orphans_done = []
        if plan.orphans:
            with self.sessions() as s, s.begin():
                owners = self._owners(s)
            for key, size in plan.orphans:
                parsed = keys.parse(key)
                if parsed and self._owned(parsed, owners) and owners[parsed.checkpoint_id][3] == DELETED:
                    self.blobs.delete(key)
                    orphans_done.append(key)
                    freed += size
        if released and freed:
            self.ballast.ensure()
        if deleted or orphans_done:
            log.info("gc deleted checkpoints %s and %d orphan blobs", deleted, len(orphans_done))
        self.metrics.gc_bytes_freed.inc(freed)
        return {"deleted": deleted, "skipped": skipped, "orphans_deleted": len(orphans_done), "bytes_freed": freed}
