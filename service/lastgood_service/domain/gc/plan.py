"""GC's planning: what would go now and the bytes freed, one short read-only
transaction per run (the package's docstring says which runs a pass plans)."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import asdict, dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ...catalog.models import COMMITTED, DELETED, PENDING, Checkpoint, Event, Run, Shard
from .. import keys
from ..commit import indexes
from ..runs.retention import Retention
from .base import GCBase, _chunks, _Row


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
class RunMark:
    """What a pass saw of one run; written back (runs.gc_*) once its deletions are done."""

    run_id: int
    run: str
    policy: str
    event_id: int                 # the run's newest event when it was planned
    due_at: dt.datetime | None    # when time alone may make something of it deletable


@dataclass
class Plan:
    policy: str
    checkpoints: list[PlannedDeletion] = field(default_factory=list)
    orphans: list[tuple[str, int]] = field(default_factory=list)  # (key, bytes) of DELETED checkpoints
    unknown: list[str] = field(default_factory=list)     # blobs lastgood cannot place: left alone
    runs: list[RunMark] = field(default_factory=list)    # the runs this plan looked at
    events_of: list[int] = field(default_factory=list)   # DELETED checkpoints whose old events go
    full: bool = True
    # run id -> its GC marks as stored when planned (event id, policy, due): a mark that
    # would write the same again is not written (a full pass over quiet runs writes nothing)
    stored: dict[int, tuple] = field(default_factory=dict, repr=False)

    @property
    def bytes_freed(self) -> int:
        return sum(d.bytes for d in self.checkpoints) + sum(n for _, n in self.orphans)

    def to_dict(self) -> dict:
        return {"policy": self.policy, "checkpoints": [asdict(d) for d in self.checkpoints],
                "orphans": [{"key": k, "bytes": n} for k, n in self.orphans], "unknown": self.unknown,
                "bytes_freed": self.bytes_freed, "full": self.full,
                "runs": [{"run": m.run, "policy": m.policy} for m in self.runs],
                "checkpoints_whose_events_go": len(self.events_of)}


class GCPlanning(GCBase):
    def plan(self, full: bool = True, run_prefix: str | None = None) -> Plan:
        """What GC would delete now. `full`: every run and the whole blob store (orphans,
        unknown blobs); else only runs where something changed since the last executed pass
        (O(changed runs): the others have nothing to delete). `run_prefix`: only runs whose
        names start with it (a scoped token's plan; never with `full`, whose store listing
        spans every run)."""
        if full and run_prefix is not None:
            raise ValueError("a full plan lists the whole store: it spans every run")
        self.gate.check()
        now = self.clock()
        plan = Plan(self.retention.describe(), full=full)
        listed: dict[int, list[tuple[str, int]]] | None = None
        if full:
            listed, status = self._listed(plan)
        with self._tx(read=True) as s:
            newest = select(func.max(Event.id)).where(Event.run_id == Run.id).scalar_subquery()
            which = select(Run.id, Run.name, Run.retention, Run.gc_event_id, Run.gc_policy, Run.gc_due_at, newest)
            if run_prefix is not None:
                which = which.where(Run.name.startswith(run_prefix, autoescape=True))
            runs = list(s.execute(which.order_by(Run.name)))
        for run_id, name, spec, seen, seen_policy, due_at, newest_id in runs:
            policy = self.policy_of(spec)
            if not full and (newest_id or 0) <= seen and seen_policy == policy.describe() and (
                    due_at is None or due_at > now):
                continue  # nothing new, same policy, nothing time alone frees: nothing to do
            with self._tx(read=True) as s:
                self._plan_run(s, plan, run_id, name, policy, now, listed)
            plan.stored[run_id] = (seen, seen_policy, due_at)
        if full:
            for cid, found in sorted(listed.items()):
                if status.get(cid) == DELETED:
                    plan.orphans += found
        return plan

    def _listed(self, plan: Plan) -> tuple[dict[int, list[tuple[str, int]]], dict[int, str]]:
        """The store's checkpoint blobs by the checkpoint that owns them (others are unknown),
        and those checkpoints' statuses."""
        stored = [(keys.parse(info.key), info) for info in self.blobs.list(keys.ROOT)]
        plan.unknown += [info.key for parsed, info in stored if parsed is None]
        stored = [(p, info) for p, info in stored if p is not None]
        owners = self._owners(sorted({p.checkpoint_id for p, _ in stored}))
        out: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for parsed, info in stored:
            if self._owned(parsed, owners):
                out[parsed.checkpoint_id].append((info.key, info.size))
            else:  # an id this catalog does not know, or another catalog history's: left alone
                plan.unknown.append(info.key)
        return out, {cid: o[3] for cid, o in owners.items()}

    def _plan_run(self, s: Session, plan: Plan, run_id: int, name: str, policy: Retention, now: dt.datetime,
                  listed: dict[int, list[tuple[str, int]]] | None) -> None:
        run_row = s.execute(select(Run.last_good_id, select(func.max(Event.id)).where(Event.run_id == run_id)
                                   .scalar_subquery()).where(Run.id == run_id)).one()
        rows = self._rows(s, run_id)
        view, protected = self._view(s, run_id, run_row[0], rows)
        kept = policy.keep(view)
        maybe = [r for r in rows if r.status not in (PENDING, DELETED) and not (r.status == COMMITTED and r.id in kept)]
        leased = self._leases(s, [r.id for r in maybe], now)
        due: list[dt.datetime] = []
        found: list[tuple[_Row, str]] = []
        for r in maybe:
            reason, when = self._why_deletable(r, kept, protected, leased, now)
            if reason:
                found.append((r, reason))
            elif when is not None:
                due.append(when)
        in_catalog = self._catalog_keys(s, [r for r, _ in found]) if listed is None else {}
        for r, reason in found:
            blobs = listed.get(r.id, []) if listed is not None else in_catalog.get(r.id, [])
            plan.checkpoints.append(PlannedDeletion(r.id, name, r.step, r.status, reason, [k for k, _ in blobs],
                                                    sum(n for _, n in blobs)))
        if self.event_retention is not None:
            cutoff = now - self.event_retention
            plan.events_of += self._with_prunable_events(s, run_id, cutoff)
            # when the next DELETED checkpoint's events come of age: one aggregate, not its rows
            nxt = s.scalar(select(func.min(Checkpoint.deleted_at)).where(
                Checkpoint.run_id == run_id, Checkpoint.status == DELETED, Checkpoint.deleted_at >= cutoff))
            if nxt is not None:
                due.append(nxt + self.event_retention)
        plan.runs.append(RunMark(run_id, name, policy.describe(), run_row[1] or 0, min(due, default=None)))

    @staticmethod
    def _catalog_keys(s: Session, rows: list[_Row]) -> dict[int, list[tuple[str, int]]]:
        """The blobs the catalog recorded for these checkpoints (an incremental pass lists no
        store: a blob it never recorded, from a crash mid-upload, waits for a full pass)."""
        out: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for chunk in _chunks([r.id for r in rows]):
            for sh in s.scalars(select(Shard).where(Shard.checkpoint_id.in_(chunk)).order_by(Shard.id)):
                if not sh.blob_key:  # a memory checkpoint's file (commit/tiering.py): in agents' memory, no blob
                    continue
                out[sh.checkpoint_id].append((sh.blob_key, sh.size))
                if (parsed := keys.parse(sh.blob_key)) and (index := indexes.key_of(parsed.prefix, sh)):
                    out[sh.checkpoint_id].append((index, 0))  # its tensor index object
        for r in rows:
            if r.manifest_key:
                out[r.id].append((r.manifest_key, 0))
        return out

    @staticmethod
    def _with_prunable_events(s: Session, run_id: int, cutoff: dt.datetime) -> list[int]:
        """The run's checkpoints deleted before `cutoff` that still have events other than
        their `gc_delete`: found by the catalog (the run's DELETED rows through the
        (run_id, status) index, each probed in the events' checkpoint index), so only the
        few ids that have something to prune come back, however long the run's history."""
        ck = Checkpoint
        prunable = select(Event.id).where(Event.checkpoint_id == ck.id, Event.kind != "gc_delete").exists()
        return list(s.scalars(select(ck.id).where(ck.run_id == run_id, ck.status == DELETED,
                                                  ck.deleted_at < cutoff, prunable).order_by(ck.id)))
