"""Garbage collection: `plan()` lists what would go and the bytes freed; `execute(plan)`
deletes at most that, re-checking each checkpoint under a row lock first.

What may go: committed checkpoints no retention policy keeps (the run's own policy, else
the service's default: domain/retention.py); CORRUPT and ABANDONED checkpoints older than
the grace period; blobs of checkpoints already DELETED (left by a crash between the
catalog update and the blob deletion). Never (I4): a PENDING checkpoint, anything a
committed manifest that is kept, a tag, a pin or a live read lease still needs. The
catalog row stays, with status DELETED, so the lineage keeps its shape; its events other
than `gc_delete` go once it has been deleted for `event_retention_seconds`.

Why it stays cheap as the catalog grows (docs/operations.md, "GC at scale"):
- a pass plans only runs where something happened since the last pass (a newer event),
  whose policy changed, or where time alone may free something (a grace period or a read
  lease ends: `runs.gc_due_at`). A full pass (`plan(full=True)`: the API's dry run, the
  first scheduled pass after a start and every `gc_full_every`-th) plans every run and
  lists the blob store for orphans and unknown blobs.
- every catalog transaction is short and bounded: planning takes one per run; execution
  marks at most `gc_batch_size` checkpoints per transaction, so commits run between
  batches; blobs are deleted outside any transaction, after their batch committed.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from sqlalchemy import bindparam, delete, func, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from ..blobstore import BlobStore
from ..catalog import txtimer
from ..metrics import Metrics
from ..catalog.models import (ABANDONED, COMMITTED, CORRUPT, DELETED, PENDING, STATUSES, Checkpoint, Event, ReadLease, Run,
                              RunStats, Shard, Tag, utcnow)
from .commit import indexes
from . import keys
from .dataplane import grants
from .events import add_event
from .faults import Ballast, is_disk_full
from .gate import CatalogGate
from .runs.retention import Retention, RunView, effective

log = logging.getLogger("lastgood.gc")

YIELD_SECONDS = 1.0  # the longest GC lets waiting transactions go first before each batch
CHUNK = 500  # ids per IN (...) list: bounded statements
MARKS = 50  # runs' GC bookkeeping written per transaction
PROTECTING_TAGS = ("tag", "alias", "pin")  # a user's tag keeps even a corrupt checkpoint
_LIVE = tuple(s for s in STATUSES if s != DELETED)  # an IN list the (run_id, status) index serves


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


class _Row(NamedTuple):
    """A checkpoint as planning reads it: a plain tuple of the columns its decisions use."""

    id: int
    branch: int
    status: str
    step: int
    attempt: str
    committed_at: dt.datetime | None
    lease_expires_at: dt.datetime
    created_at: dt.datetime
    manifest_key: str | None


class _ViewRow(NamedTuple):
    """What the policies need of a COMMITTED checkpoint: no times, so a batch's re-read of
    the run decodes no datetimes (on PostgreSQL every batch re-reads the run: see _kept)."""

    id: int
    branch: int
    step: int
    status: str = COMMITTED


class _Collected(list):
    """Stands in for a session to add_event: keeps the Event rows for one bulk insert."""

    add = list.append


_EVENT_COLUMNS = ("run_id", "checkpoint_id", "kind", "at", "data_json")


def _gc_event(run_id: int, d: PlannedDeletion, now: dt.datetime) -> dict:
    """The `gc_delete` event of one planned deletion, as a row for a bulk insert (the
    same row add_event would add)."""
    rows = _Collected()
    add_event(rows, "gc_delete", run_id, d.checkpoint_id, step=d.step, reason=d.reason, bytes=d.bytes, was=d.status)
    return {c: getattr(rows[0], c) for c in _EVENT_COLUMNS}


def next_batch_size(size: int, held: float, target: float, cap: int) -> int:
    """The next batch's size from how long this one held the catalog: scaled towards
    `target` seconds (at most doubling, so one quick batch does not jump to the cap),
    between a tenth of `cap` and `cap`. A batch's cost per checkpoint depends on the run
    (its size, on PostgreSQL) and on the machine's load, so a fixed count cannot bound
    its time; a batch also has a fixed cost (its statements, re-reading the run), which
    the floor keeps from being paid once per checkpoint."""
    floor = max(1, cap // 10)
    if held <= 0:
        return min(cap, size * 2)
    return max(floor, min(cap, size * 2, int(size * target / held)))


def _chunks(items: list, n: int = CHUNK) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class GarbageCollector:
    def __init__(self, sessions: sessionmaker[Session], blobs: BlobStore, retention: Retention,
                 grace_seconds: float, clock: Callable[[], dt.datetime] = utcnow, metrics: Metrics | None = None,
                 gate: CatalogGate | None = None, ballast: Ballast | None = None, batch_size: int = 100,
                 full_every: int = 24, event_retention_seconds: float = 30 * 24 * 3600.0,
                 read_sessions: sessionmaker[Session] | None = None, batch_seconds: float = 0.02,
                 grant_seconds: float = 3600.0) -> None:
        self.sessions = sessions
        self.grant_seconds = grant_seconds  # direct uploads: how long a grant lives (grants.sweep)
        self.read_sessions = read_sessions or sessions  # planning only reads (catalog/db.py)
        self.ballast = ballast or Ballast(None, 0)
        self.gate = gate or CatalogGate()  # closed: the blobs of lost commits look deletable
        self.blobs = blobs
        self.retention = retention  # the service's default; a run may carry its own
        self.grace = dt.timedelta(seconds=grace_seconds)
        self.clock = clock
        self.metrics = metrics or Metrics()  # a private registry when the caller keeps none
        self.batch_size = batch_size  # the most checkpoints a batch marks
        self.batch_seconds = batch_seconds  # what a batch should hold the catalog for: sizes adapt to it
        self._next_batch = batch_size
        self.full_every = full_every
        self.event_retention = dt.timedelta(seconds=event_retention_seconds) if event_retention_seconds else None
        self.passes = 0
        self._need_full = True  # the first scheduled pass after a start: a crash may have left orphans
        self.timer = txtimer.of(sessions)
        self._kept_cache: dict[int, tuple] = {}  # run id -> what _kept found, and when
        self.last_pass: dict = {}

    @contextmanager
    def _tx(self, read: bool = False) -> Iterator[Session]:
        """One short catalog transaction of GC's, labelled "gc" in the engine's TxTimer;
        transactions waiting for the lock go first (GC is the one that can wait). `read`:
        planning, which only reads (on SQLite, without the write lock)."""
        if self.timer:
            self.timer.let_waiters_in(YIELD_SECONDS)
        with txtimer.labelled("gc"), (self.read_sessions if read else self.sessions)() as s, s.begin():
            yield s

    # ---------------------------------------------------------------- decisions
    @staticmethod
    def _rows(s: Session, run_id: int) -> list[_Row]:
        """The run's checkpoints that are not DELETED: a run that has lived long is mostly
        DELETED rows, which nothing GC decides reads (the policies see committed rows and
        their stored branches), so a plan's memory follows what is kept, not the run's age."""
        # sorted here, not by ORDER BY id: that makes SQLite walk the run's (run_id, id) index,
        # every DELETED row included, instead of the (run_id, status) ranges of the live ones
        return sorted(_Row(*r) for r in s.execute(
            select(Checkpoint.id, Checkpoint.branch, Checkpoint.status, Checkpoint.step, Checkpoint.attempt,
                   Checkpoint.committed_at, Checkpoint.lease_expires_at, Checkpoint.created_at,
                   Checkpoint.manifest_key)
            .where(Checkpoint.run_id == run_id, Checkpoint.status.in_(_LIVE))))

    @staticmethod
    def _view_rows(s: Session, run_id: int) -> list[_ViewRow]:
        """Only the run's COMMITTED rows: all that the policies see (see _view)."""
        return sorted(_ViewRow(*r) for r in s.execute(  # sorted here: see _rows
            select(Checkpoint.id, Checkpoint.branch, Checkpoint.step)
            .where(Checkpoint.run_id == run_id, Checkpoint.status == COMMITTED)))

    @staticmethod
    def _view(s: Session, run_id: int, last_good_id: int | None,
              rows: list[_Row] | list[_ViewRow]) -> tuple[RunView, set[int]]:
        """What the policies see of the run, and the checkpoints a user's tag or pin protects.
        A branch's head is its newest COMMITTED checkpoint, by the branch stored with each
        row (domain/branches.py): no walk over the run's DELETED history."""
        heads: dict[int, tuple[int, int]] = {}
        committed = [r for r in rows if r.status == COMMITTED]
        for r in committed:
            heads[r.branch] = max(heads.get(r.branch, (r.step, r.id)), (r.step, r.id))
        tags: dict[int, set[str]] = defaultdict(set)
        protected: set[int] = set()
        for cid, name, kind in s.execute(select(Tag.checkpoint_id, Tag.name, Tag.kind).where(Tag.run_id == run_id)):
            tags[cid].add(name)
            if kind in PROTECTING_TAGS:
                protected.add(cid)
        view = RunView(last_good_id, [(r.id, r.step) for r in committed], dict(tags),
                       {cid for _, cid in heads.values()})
        return view, protected

    @staticmethod
    def _leases(s: Session, ids: list[int], now: dt.datetime) -> dict[int, dt.datetime]:
        """checkpoint id -> when its last live read lease ends."""
        out: dict[int, dt.datetime] = {}
        for chunk in _chunks(ids):
            out.update(s.execute(select(ReadLease.checkpoint_id, func.max(ReadLease.expires_at))
                                 .where(ReadLease.checkpoint_id.in_(chunk), ReadLease.expires_at > now)
                                 .group_by(ReadLease.checkpoint_id)).all())
        return out

    def _why_deletable(self, ck: _Row | Checkpoint, kept: set[int], protected: set[int],
                       leased: dict[int, dt.datetime], now: dt.datetime) -> tuple[str | None, dt.datetime | None]:
        """(why ck may go, or None) and, when it may not yet, when time alone could change that."""
        if ck.status == PENDING or ck.status == DELETED:
            return None, None
        if ck.id in leased:
            return None, leased[ck.id]
        if ck.id in protected:
            return None, None  # a user tagged or pinned it, even if corrupt, whatever the policy says (I4)
        if ck.status == COMMITTED:
            return (None if ck.id in kept else "not kept by the retention policy"), None
        since = ck.committed_at or ck.lease_expires_at or ck.created_at
        if ck.status in (ABANDONED, CORRUPT):
            if since + self.grace < now:
                return f"{ck.status.lower()} for longer than the grace period", None
            return None, since + self.grace
        return None, None

    def policy_of(self, run_spec: str | None) -> Retention:
        return effective(run_spec, self.retention)

    # ---------------------------------------------------------------- plan
    def plan(self, full: bool = True) -> Plan:
        """What GC would delete now. `full`: every run and the whole blob store (orphans,
        unknown blobs); else only runs where something changed since the last executed pass."""
        self.gate.check()
        now = self.clock()
        plan = Plan(self.retention.describe(), full=full)
        listed: dict[int, list[tuple[str, int]]] | None = None
        if full:
            listed, status = self._listed(plan)
        with self._tx(read=True) as s:
            newest = select(func.max(Event.id)).where(Event.run_id == Run.id).scalar_subquery()
            runs = list(s.execute(select(Run.id, Run.name, Run.retention, Run.gc_event_id, Run.gc_policy,
                                         Run.gc_due_at, newest).order_by(Run.name)))
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

    def _owners(self, ids: list[int]) -> dict[int, tuple[str, int, str, str]]:
        """checkpoint id -> (run, step, attempt, status), for placing blobs by their keys."""
        out: dict[int, tuple[str, int, str, str]] = {}
        for chunk in _chunks(ids):
            with self._tx(read=True) as s:
                out.update({cid: (run, step, attempt, status) for cid, run, step, attempt, status in s.execute(
                    select(Checkpoint.id, Run.name, Checkpoint.step, Checkpoint.attempt, Checkpoint.status)
                    .join(Run, Run.id == Checkpoint.run_id).where(Checkpoint.id.in_(chunk)))})
        return out

    @staticmethod
    def _owned(parsed: keys.ParsedKey, owners: dict) -> bool:
        owner = owners.get(parsed.checkpoint_id)
        return owner is not None and keys.belongs_to(parsed, parsed.checkpoint_id, *owner[:3])

    # ---------------------------------------------------------------- execute
    def _kept(self, s: Session, run_id: int) -> tuple[set[int], set[int]]:
        """What the run's policy keeps now, and what a user's tag protects. Every change that
        could alter either (a checkpoint begun or changing status other than to DELETED, a
        tag, pin or alias, last-good moving) bumps the run's `run_stats.changes` in its own
        transaction (the catalog's triggers, migration 0007), and a policy change shows in
        `runs.retention`. So an answer stands while both are as they were when it was read:
        a batch re-reads the run (O(its checkpoints)) only if something changed. Deleting
        what no policy keeps changes nothing they keep, so GC's own deletions do not count.
        The counter is read first: a change landing between it and the view makes the
        answer look older than it is (read again next time), never newer."""
        changes = s.scalar(select(RunStats.changes).where(RunStats.run_id == run_id))
        last_good_id, retention = s.execute(select(Run.last_good_id, Run.retention).where(Run.id == run_id)).one()
        cached = self._kept_cache.get(run_id)
        if cached and changes is not None and cached[:2] == (changes, retention):
            return cached[2], cached[3]
        view, protected = self._view(s, run_id, last_good_id, self._view_rows(s, run_id))
        kept = self.policy_of(retention).keep(view)
        self._kept_cache[run_id] = (changes, retention, kept, protected)
        return kept, protected

    def _mark_batch(self, run_id: int, batch: list[PlannedDeletion],
                    now: dt.datetime) -> tuple[list[PlannedDeletion], float]:
        """Re-check a batch of one run's planned deletions under row locks, with the run's
        policy as it is now, and mark DELETED those still deletable: one short transaction.
        What does not need the catalog (the `gc_delete` events' JSON) is built before it
        begins, and the rows are read as plain tuples of the columns the checks use: a
        batch's hold is its statements, not Python building ORM objects under the lock.
        Returns what it marked and how long it held the catalog."""
        events = {d.checkpoint_id: _gc_event(run_id, d, now) for d in batch}
        if run_id not in self._kept_cache:
            with self._tx(read=True) as s:  # the run's view read beside the writers, not under the lock
                self._kept(s, run_id)
        with self._tx() as s:
            began = time.perf_counter()
            locked = {r.id: r for r in s.execute(
                select(Checkpoint.id, Checkpoint.run_id, Checkpoint.status, Checkpoint.committed_at,
                       Checkpoint.lease_expires_at, Checkpoint.created_at)
                # in id order, as vote batches and lease expiry lock them: no deadlock between them
                .where(Checkpoint.id.in_(list(events))).order_by(Checkpoint.id).with_for_update())}
            kept, protected = self._kept(s, run_id)  # after the row locks: sees what committed before them
            leased = self._leases(s, list(locked), now)
            marked = []
            for d in batch:
                ck = locked.get(d.checkpoint_id)
                if ck is None or ck.run_id != run_id or ck.status != d.status:
                    continue
                if self._why_deletable(ck, kept, protected, leased, now)[0] is None:
                    continue
                marked.append(d)
            if marked:  # two statements for the batch, not two per checkpoint
                for status in {d.status for d in marked}:
                    s.execute(update(Checkpoint).where(
                        Checkpoint.id.in_([d.checkpoint_id for d in marked if d.status == status]),
                        Checkpoint.status == status).values(status=DELETED, deleted_at=now)
                        .execution_options(synchronize_session=False))
                s.execute(insert(Event), [events[d.checkpoint_id] for d in marked])
            held = time.perf_counter() - began  # to COMMIT, as the engine's TxTimer counts a hold
        return marked, held

    def _retrying(self, fn, *args):
        try:
            return fn(*args), False
        except Exception as e:
            if not is_disk_full(e) or not self.ballast.release():
                raise
            return fn(*args), True  # the catalog could not write at all: give it the ballast's room

    def execute(self, plan: Plan) -> dict:
        """Delete what the plan lists, and nothing else; skip whatever is no longer deletable."""
        self.gate.check()
        deleted, skipped, freed = [], [], 0
        now = self.clock()
        released = False
        self._kept_cache = {}  # see _kept
        run_ids = {m.run: m.run_id for m in plan.runs}
        by_run: dict[str, list[PlannedDeletion]] = defaultdict(list)
        for d in plan.checkpoints:
            by_run[d.run].append(d)
        unsettled: set[str] = set()  # runs with a skip: planned again next pass
        for run, planned in by_run.items():
            run_id = run_ids.get(run) or self._run_id(run)
            i = 0
            while i < len(planned):
                batch = planned[i:i + self._next_batch]
                i += len(batch)
                (marked, held), r = self._retrying(self._mark_batch, run_id, batch, now) if run_id else (([], 0), False)
                if run_id:
                    self._next_batch = next_batch_size(len(batch), held, self.batch_seconds, self.batch_size)
                released |= r
                done = {d.checkpoint_id for d in marked}
                if len(done) < len(batch):
                    unsettled.add(run)
                    skipped += [d.checkpoint_id for d in batch if d.checkpoint_id not in done]
                for d in marked:  # only after the catalog says DELETED: a crash leaves orphans, never holes
                    for key in d.keys:
                        self.blobs.delete(key)
                    deleted.append(d.checkpoint_id)
                    freed += d.bytes
        orphans_done = self._delete_orphans(plan.orphans)
        grants.sweep(self.sessions, self.blobs, now, self.grant_seconds)  # direct S3 uploads (domain/grants.py)
        freed += sum(n for _, n in orphans_done)
        events_pruned = self._prune_events(plan.events_of, now)
        self._write_marks([m for m in plan.runs if m.run not in unsettled
                           and plan.stored.get(m.run_id) != (m.event_id, m.policy, m.due_at)])
        if released and freed:
            self.ballast.ensure()
        if deleted or orphans_done:
            log.info("gc deleted checkpoints %s and %d orphan blobs", deleted, len(orphans_done))
        self.metrics.gc_bytes_freed.inc(freed)
        return {"deleted": deleted, "skipped": skipped, "orphans_deleted": len(orphans_done), "bytes_freed": freed,
                "events_pruned": events_pruned}

    def _run_id(self, name: str) -> int | None:
        with self._tx(read=True) as s:
            return s.scalar(select(Run.id).where(Run.name == name))

    def _delete_orphans(self, orphans: list[tuple[str, int]]) -> list[tuple[str, int]]:
        if not orphans:
            return []
        parsed = [(keys.parse(k), k, n) for k, n in orphans]
        owners = self._owners(sorted({p.checkpoint_id for p, _, _ in parsed if p}))
        done = []
        for p, key, size in parsed:
            if p and self._owned(p, owners) and owners[p.checkpoint_id][3] == DELETED:
                self.blobs.delete(key)
                done.append((key, size))
        return done

    def _prune_events(self, ids: list[int], now: dt.datetime) -> int:
        """Events of checkpoints deleted longer ago than the event retention, but the
        `gc_delete` that says what happened to each: bounded deletes, one short transaction each."""
        if self.event_retention is None or not ids:
            return 0
        cutoff, n = now - self.event_retention, 0
        for chunk in _chunks(ids):
            with self._tx() as s:
                gone = select(Checkpoint.id).where(Checkpoint.id.in_(chunk), Checkpoint.status == DELETED,
                                                   Checkpoint.deleted_at < cutoff)
                n += s.execute(delete(Event).where(Event.checkpoint_id.in_(gone), Event.kind != "gc_delete")
                               .execution_options(synchronize_session=False)).rowcount or 0
        return n

    def _write_marks(self, marks: Iterable[RunMark]) -> None:
        """One executemany per transaction of at most MARKS runs (a statement a run held
        the lock for 180 ms for 100 runs on a loaded machine)."""
        t = Run.__table__
        for chunk in _chunks(list(marks), MARKS):
            with self._tx() as s:
                s.connection().execute(update(t).where(t.c.id == bindparam("rid")).values(
                    gc_event_id=bindparam("eid"), gc_policy=bindparam("pol"), gc_due_at=bindparam("due")),
                    [{"rid": m.run_id, "eid": m.event_id, "pol": m.policy, "due": m.due_at} for m in chunk])

    # ---------------------------------------------------------------- the scheduled pass
    def run_pass(self) -> dict:
        """One scheduled pass: incremental, but full on the first after a start, after a
        failed pass, and every `full_every`-th (orphans come only from a crash or a failure)."""
        full = self._need_full or self.passes % self.full_every == 0
        mark = self.timer.total if self.timer else 0
        t0 = time.perf_counter()
        self._need_full = True
        plan = self.plan(full=full)
        t1 = time.perf_counter()
        result = self.execute(plan)
        t2 = time.perf_counter()
        self._need_full = False
        self.passes += 1
        holds = [r.hold for r in self.timer.since(mark, "gc")] if self.timer else []
        for h in holds:
            self.metrics.gc_transaction_seconds.observe(h)
        self.last_pass = {"full": full, "runs_planned": len(plan.runs), "planned": len(plan.checkpoints),
                          "deleted": len(result["deleted"]), "plan_seconds": t1 - t0, "execute_seconds": t2 - t1,
                          "transactions": len(holds), "longest_transaction_seconds": max(holds, default=0.0),
                          "events_pruned": result["events_pruned"]}
        return self.last_pass
