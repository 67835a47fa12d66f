"""GC's execution: delete at most what a plan lists, re-checking each checkpoint under its
row lock with the run's policy as it is then, in batches whose size adapts to how long
each held the catalog; blobs go after their batch committed."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import defaultdict
from collections.abc import Iterable

from sqlalchemy import bindparam, delete, insert, select, update
from sqlalchemy.orm import Session

from ...catalog.models import DELETED, Checkpoint, Event, Run, RunStats
from .. import keys
from ..dataplane import grants
from ..events import add_event
from ..faults import is_disk_full
from .base import MARKS, GCBase, _chunks
from .plan import Plan, PlannedDeletion, RunMark

log = logging.getLogger("lastgood.gc")


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


class GCExecution(GCBase):
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
        grants.sweep(self.sessions, self.blobs, now, self.grant_seconds)  # direct S3 uploads (dataplane/grants.py)
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
