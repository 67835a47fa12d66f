"""What GC's planning and its execution share: the collector's state and its short
transactions, and the decisions both make, planning over every checkpoint of a run and
execution again under the row locks (why a checkpoint may go, what the policies see)."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from ...blobstore import BlobStore
from ...catalog import txtimer
from ...catalog.models import (ABANDONED, COMMITTED, CORRUPT, DELETED, MEMORY, PENDING, STATUSES, Checkpoint, ReadLease,
                               Run, Tag, utcnow)
from ...metrics import Metrics
from .. import keys
from ..faults import Ballast
from ..gate import CatalogGate
from ..runs.retention import Retention, RunView, effective

YIELD_SECONDS = 1.0  # the longest GC lets waiting transactions go first before each batch
CHUNK = 500  # ids per IN (...) list: bounded statements
MARKS = 50  # runs' GC bookkeeping written per transaction
PROTECTING_TAGS = ("tag", "alias", "pin")  # a user's tag keeps even a corrupt checkpoint
_LIVE = tuple(s for s in STATUSES if s != DELETED)  # an IN list the (run_id, status) index serves


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


def _chunks(items: list, n: int = CHUNK) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class GCBase:
    """The collector's state; planning (plan.py) and execution (execute.py) build on it."""

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
        row (domain/runs/branches.py): no walk over the run's DELETED history."""
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
        memory = set(s.scalars(select(Checkpoint.id).where(  # the memory tier's (runs/retention.py)
            Checkpoint.run_id == run_id, Checkpoint.status == COMMITTED, Checkpoint.tier == MEMORY)))
        view = RunView(last_good_id, [(r.id, r.step) for r in committed], dict(tags),
                       {cid for _, cid in heads.values()}, memory)
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
