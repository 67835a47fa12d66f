"""Read-only views of the catalog for the REST API. Plain dicts out; no HTTP types here."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from lastgood.wire import jsonvalues, names

from ..catalog.models import STATUSES, Checkpoint, Event, ReadLease, Run, RunStats
from ..catalog.models import CORRUPT, DECLARED, PENDING, Shard, Vote
from .events import FAILURE_WINDOW_S, recent_failures
from .runs import last_good, lineage
from .gate import CatalogGate
from .errors import Damaged, FailedPrecondition, InvalidArgument, NoCheckpoint, NotFound, NoUsableCheckpoint
from .runs.lineage import tags_by_checkpoint
from .runs.retention import Retention

MAX_PAGE = 1000
MAX_LINEAGE = 10000
# a lineage page when none is asked for: what one answer builds and holds at once (the web
# page and the CLI page through longer runs); the whole 10,000 would make every poll of a
# long run a multi-MB peak that the service's RSS keeps
LINEAGE_PAGE = 1000
EVENT_KIND = r"[a-z_]{1,32}"  # an event kind a listing may filter by
_EVENT_KIND = re.compile(EVENT_KIND)


def _iso(t):
    return t.isoformat() if t is not None else None


def checkpoint_view(ck: Checkpoint, run: Run, tags: list[dict] | None = None) -> dict:
    return {
        "id": ck.id, "run": run.name, "step": ck.step, "attempt": ck.attempt, "generation": ck.generation,
        "world_size": ck.world_size, "tier": ck.tier,
        "parent_id": ck.parent_id, "status": ck.status, "bytes": ck.bytes,
        "created_at": _iso(ck.created_at), "committed_at": _iso(ck.committed_at),
        "lease_expires_at": _iso(ck.lease_expires_at) if ck.status == "PENDING" else None,
        "last_good": run.last_good_id == ck.id,
        "tags": tags if tags is not None else [],
    }


def _event_data(text: str):
    """An event's data as strict JSON can carry it, whatever the row holds: NaN, Infinity or
    a lone surrogate in one row would otherwise make every read of the run's events fail."""
    try:
        return jsonvalues.carried(json.loads(text))
    except (ValueError, RecursionError):
        return {"unreadable": jsonvalues.carried(text[:200])}


def _page(limit: int, offset: int) -> None:
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidArgument(f"limit must be 1..{MAX_PAGE}, got {limit}")
    if offset < 0:
        raise InvalidArgument(f"offset must be >= 0, got {offset}")


class Queries:
    def __init__(self, sessions: sessionmaker[Session], gate: CatalogGate | None = None) -> None:
        self.sessions = sessions
        self.gate = gate or CatalogGate()

    def _run(self, s: Session, name: str) -> Run:
        try:
            names.check_run_name(name)
        except names.InvalidName as e:
            raise InvalidArgument(str(e)) from None
        run = s.scalar(select(Run).where(Run.name == name))
        if run is None:
            raise NotFound(f"run {name!r} does not exist")
        return run

    @staticmethod
    def _runs_page(s: Session, prefix: str | None, limit: int, offset: int) -> tuple[int, list[Run]]:
        """One page of runs by name, limited to a token's run prefix when it has one."""
        q = select(Run)
        if prefix:
            q = q.where(Run.name.startswith(prefix, autoescape=True))
        total = s.scalar(select(func.count()).select_from(q.subquery()))
        return total, list(s.scalars(q.order_by(Run.name).limit(limit).offset(offset)))

    def list_runs(self, limit: int = 100, offset: int = 0, prefix: str | None = None) -> dict:
        """Runs by name; `prefix` limits them to a token's scope."""
        _page(limit, offset)
        with self.sessions() as s, s.begin():
            total, runs = self._runs_page(s, prefix, limit, offset)
            items = self._run_views(s, runs)
        return {"items": items, "total": total, "limit": limit, "offset": offset}

    @staticmethod
    def _stats(s: Session, ids: list[int]) -> dict[int, RunStats]:
        """The runs' counters (run_stats, kept by the catalog's triggers: migration 0007):
        one row a run, however many checkpoints it has."""
        return {st.run_id: st for st in s.scalars(select(RunStats).where(RunStats.run_id.in_(ids)))}

    @staticmethod
    def _counts(stats: dict[int, RunStats], run_id: int) -> dict[str, int]:
        st = stats.get(run_id)
        return st.by_status() if st is not None else dict.fromkeys(STATUSES, 0)

    @classmethod
    def _run_views(cls, s: Session, runs: list[Run]) -> list[dict]:
        """Runs with their last-good and checkpoints by status: two queries for the page,
        of O(runs) rows, not two a run nor a count of their checkpoints."""
        ids = [r.id for r in runs]
        stats = cls._stats(s, ids)
        counts = {i: cls._counts(stats, i) for i in ids}
        lg_ids = [r.last_good_id for r in runs if r.last_good_id]
        lgs = {c.id: c for c in s.scalars(select(Checkpoint).where(Checkpoint.id.in_(lg_ids)))} if lg_ids else {}
        return [{"name": r.name, "created_at": _iso(r.created_at), "generation": r.generation,
                 "last_good": checkpoint_view(lgs[r.last_good_id], r) if r.last_good_id in lgs else None,
                 "checkpoints": counts[r.id]} for r in runs]

    def _run_view(self, s: Session, run: Run) -> dict:
        return self._run_views(s, [run])[0]

    def get_run(self, name: str) -> dict:
        with self.sessions() as s, s.begin():
            return self._run_view(s, self._run(s, name))

    def list_checkpoints(self, run_name: str, status: str | None = None, limit: int = 100, offset: int = 0) -> dict:
        _page(limit, offset)
        if status is not None and status not in STATUSES:
            raise InvalidArgument(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        with self.sessions() as s, s.begin():
            run = self._run(s, run_name)
            q = select(Checkpoint).where(Checkpoint.run_id == run.id)
            if status:
                q = q.where(Checkpoint.status == status)
            total = s.scalar(select(func.count()).select_from(q.subquery()))
            rows = list(s.scalars(q.order_by(Checkpoint.step.desc(), Checkpoint.id.desc()).limit(limit).offset(offset)))
            tags = tags_by_checkpoint(s, run, [ck.id for ck in rows])
            return {"items": [checkpoint_view(ck, run, tags.get(ck.id, [])) for ck in rows], "total": total,
                    "limit": limit, "offset": offset}

    @staticmethod
    def _checkpoint(s: Session, checkpoint_id: int) -> tuple[Checkpoint, Run]:
        ck = s.get(Checkpoint, checkpoint_id)
        if ck is None:
            raise NotFound(f"checkpoint {checkpoint_id} does not exist")
        return ck, s.get(Run, ck.run_id)

    def get_checkpoint(self, checkpoint_id: int) -> dict:
        with self.sessions() as s, s.begin():
            ck, run = self._checkpoint(s, checkpoint_id)
            return checkpoint_view(ck, run, tags_by_checkpoint(s, run, [ck.id]).get(ck.id, []))

    def last_good(self, run_name: str) -> dict:
        """The run's last-good, or why there is none, three ways apart: the run does not
        exist (NotFound), it never committed a checkpoint (NoCheckpoint), or it did and none
        is usable any more (NoUsableCheckpoint: they were found damaged). A job starts from
        scratch on the first two only."""
        self.gate.check()  # a catalog behind the store would hand out an older step as last-good
        with self.sessions() as s, s.begin():
            run = self._run(s, run_name)
            if run.last_good_id is None:
                damaged = list(s.scalars(select(Checkpoint.id).where(Checkpoint.run_id == run.id,
                                                                     Checkpoint.status == CORRUPT)
                                         .order_by(Checkpoint.id.desc()).limit(10)))
                if damaged or s.scalar(select(Checkpoint.id).where(Checkpoint.run_id == run.id,
                                                                   Checkpoint.committed_at.is_not(None)).limit(1)):
                    raise NoUsableCheckpoint(
                        f"run {run_name!r} has committed checkpoints but none is usable: last-good was found damaged "
                        f"and has no good ancestor (CORRUPT: {damaged}{', ...' if len(damaged) == 10 else ''}); "
                        f"restore a checkpoint by id, or start a new run to train from scratch")
                raise NoCheckpoint(f"run {run_name!r} has no committed checkpoint")
            ck = s.get(Checkpoint, run.last_good_id)
            return checkpoint_view(ck, run, tags_by_checkpoint(s, run, [ck.id]).get(ck.id, []))

    def readable_last_good(self, run_name: str, manifest_bytes: Callable[[int], bytes]) -> tuple[dict, bytes]:
        """The run's last-good and its manifest, read and checked (`manifest_bytes`,
        CommitService's). A manifest found missing or damaged there marks its checkpoint
        CORRUPT and moves last-good back to the newest usable ancestor, so the answer is
        that ancestor, or NoUsableCheckpoint once none is left: never "no checkpoint" for
        a run that had some. Each turn marks one more checkpoint CORRUPT, so it ends."""
        seen: set[int] = set()
        while True:
            view = self.last_good(run_name)
            try:
                return view, manifest_bytes(view["id"])
            except (Damaged, FailedPrecondition):  # FailedPrecondition: marked CORRUPT meanwhile
                if view["id"] in seen:  # last-good did not move: not something to walk past
                    raise
                seen.add(view["id"])

    def pending_count(self) -> int:
        with self.sessions() as s, s.begin():
            return s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.status == "PENDING"))

    def run_of_checkpoint(self, checkpoint_id: int) -> str:
        with self.sessions() as s, s.begin():
            return self._checkpoint(s, checkpoint_id)[1].name

    def run_of_lease(self, lease_id: int) -> str:
        with self.sessions() as s, s.begin():
            lease = s.get(ReadLease, lease_id)
            if lease is None:
                raise NotFound(f"lease {lease_id} does not exist")
            return self._checkpoint(s, lease.checkpoint_id)[1].name

    def lineage_json(self, run_name: str, limit: int = LINEAGE_PAGE, offset: int = 0) -> bytes:
        """A lineage page as the REST answer's JSON text (domain/runs/lineage.py says why text)."""
        if not 1 <= limit <= MAX_LINEAGE or offset < 0:
            raise InvalidArgument(f"limit must be 1..{MAX_LINEAGE} and offset >= 0")
        with self.sessions() as s, s.begin():
            return lineage.lineage_json(s, self._run(s, run_name), limit, offset)

    def lineage(self, run_name: str, limit: int = LINEAGE_PAGE, offset: int = 0) -> dict:
        """The same page as plain values (tests, tools): the text parsed, one builder of it."""
        return json.loads(self.lineage_json(run_name, limit, offset))

    def ancestors(self, checkpoint_id: int) -> dict:
        with self.sessions() as s, s.begin():
            ck, run = self._checkpoint(s, checkpoint_id)
            ids = lineage.ancestors(s, ck)
            rows = {c.id: c for c in s.scalars(select(Checkpoint).where(Checkpoint.id.in_(ids)))}
            tags = tags_by_checkpoint(s, run, ids)
            # where a restore goes when this checkpoint is unusable (the service's one rule)
            return {"checkpoint_id": ck.id, "fallback_id": last_good.usable_ancestor(s, ck),
                    "items": [checkpoint_view(rows[i], run, tags.get(i, [])) for i in ids]}

    def events(self, run_name: str, limit: int = 100, offset: int = 0, kinds: list[str] | None = None) -> dict:
        """The run's events, oldest first; `kinds` keeps only those kinds (the web page's timeline)."""
        _page(limit, offset)
        if kinds is not None and (not kinds or not all(_EVENT_KIND.fullmatch(k) for k in kinds)):
            raise InvalidArgument("kind must be a comma list of event kinds such as spike,rollback,restart")
        with self.sessions() as s, s.begin():
            run = self._run(s, run_name)
            q = select(Event).where(Event.run_id == run.id)
            if kinds:
                q = q.where(Event.kind.in_(kinds))
            total = s.scalar(select(func.count()).select_from(q.subquery()))
            rows = s.scalars(q.order_by(Event.at, Event.id).limit(limit).offset(offset))
            items = [{"id": e.id, "kind": e.kind, "at": _iso(e.at), "checkpoint_id": e.checkpoint_id,
                      "data": _event_data(e.data_json)} for e in rows]
        return {"items": items, "total": total, "limit": limit, "offset": offset}

    # ---------------------------------------------------------------- the web page's views
    def overview(self, limit: int = 100, offset: int = 0, prefix: str | None = None,
                 failure_window_seconds: float = FAILURE_WINDOW_S) -> dict:
        """Runs with what the runs list shows: last-good, checkpoints by status, bytes still
        stored (everything not DELETED), last activity (the newest event), pending saves and
        the failures within the window (events.FAILURE_EVENTS: aborts, given-up saves, expiries,
        corruptions, hash mismatches, hangs, lost ranks, relaunches), and
        how many loss spikes and rollbacks the run has had (ever: a rollback is history).
        `last_event_id` changes whenever anything happens to the run: the page polls it."""
        _page(limit, offset)
        with self.sessions() as s, s.begin():
            total, runs = self._runs_page(s, prefix, limit, offset)
            ids = [r.id for r in runs]
            stats = self._stats(s, ids)
            counts = {i: self._counts(stats, i) for i in ids}
            # each run's newest event by the (run_id, id) index: one probe a run, not a scan of its events
            newest = select(func.max(Event.id)).where(Event.run_id == Run.id).scalar_subquery()
            newest_ids = [e for e in s.scalars(select(newest).where(Run.id.in_(ids))) if e is not None]
            last = {r: (eid, at) for eid, r, at in s.execute(
                select(Event.id, Event.run_id, Event.at).where(Event.id.in_(newest_ids)))}
            fails = {r: (f["count"], f["last_at"]) for r, f in recent_failures(s, ids, failure_window_seconds).items()}
            spikes = {(r, k): n for r, k, n in s.execute(
                select(Event.run_id, Event.kind, func.count())
                .where(Event.run_id.in_(ids), Event.kind.in_(("spike", "rollback")))
                .group_by(Event.run_id, Event.kind))}
            lg_ids = [r.last_good_id for r in runs if r.last_good_id]
            lg_step = dict(s.execute(select(Checkpoint.id, Checkpoint.step).where(Checkpoint.id.in_(lg_ids))).all())
            items = [{
                "name": r.name, "created_at": _iso(r.created_at),
                "last_good": {"id": r.last_good_id, "step": lg_step[r.last_good_id]} if r.last_good_id else None,
                "checkpoints": counts[r.id], "total_checkpoints": sum(counts[r.id].values()),
                "bytes_stored": stats[r.id].bytes_stored if r.id in stats else 0, "pending": counts[r.id][PENDING],
                "newest_step": stats[r.id].newest_step if r.id in stats else None,
                "last_activity": _iso(last.get(r.id, (None, r.created_at))[1]),
                "last_event_id": last.get(r.id, (0, None))[0],
                "recent_failures": fails.get(r.id, (0, None))[0],
                "last_failure_at": _iso(fails.get(r.id, (0, None))[1]),
                "spikes": spikes.get((r.id, "spike"), 0), "rollbacks": spikes.get((r.id, "rollback"), 0),
            } for r in runs]
        return {"items": items, "total": total, "limit": limit, "offset": offset,
                "failure_window_seconds": failure_window_seconds}

    def shards(self, checkpoint_id: int) -> dict:
        """A checkpoint's files as the catalog has them, whatever its status (a manifest
        exists only once it committed): per rank, each file's size, xxh3-128 (null while
        DECLARED) and state."""
        with self.sessions() as s, s.begin():
            ck, run = self._checkpoint(s, checkpoint_id)
            rows = list(s.scalars(select(Shard).where(Shard.checkpoint_id == ck.id)
                                  .order_by(Shard.rank, Shard.file_name)))
            voted = set(s.scalars(select(Vote.rank).where(Vote.checkpoint_id == ck.id)))
            ranks: dict[int, list[dict]] = {r: [] for r in sorted(voted)}
            for sh in rows:
                # a DECLARED file's digest is its writer's claim, not yet checked: a peer checker
                # must not learn it (domain/peer/verification_modes.py), so it is shown once verified
                ranks.setdefault(sh.rank, []).append(
                    {"name": sh.file_name, "size": sh.size,
                     "xxh3_128": None if sh.status == DECLARED else sh.xxh3_128, "status": sh.status})
            return {"checkpoint_id": ck.id, "run": run.name, "status": ck.status, "world_size": ck.world_size,
                    "ranks": [{"rank": r, "voted": r in voted, "files": ranks[r]} for r in sorted(ranks)]}


_POLICY_TEXT = {
    "latest": "keeps the {n} newest committed checkpoints of each run",
    "every": "keeps the first committed checkpoint of every {n}-step window",
    "tagged": "keeps tagged, aliased, pinned checkpoints and rollback targets",
    "last-good": "keeps each run's last-good checkpoint",
    "branch-heads": "keeps the newest committed checkpoint of every branch",
}


def gc_policy_view(retention: Retention, grace_seconds: float, interval_seconds: float) -> dict:
    """The retention policy in force, each part with a sentence saying what it keeps."""
    parts = []
    for p in retention.policies:
        spec = p.describe()
        n = spec.partition(":")[2]
        parts.append({"name": p.name, "spec": spec, "keeps": _POLICY_TEXT.get(p.name, spec).format(n=n)})
    return {"retention": retention.describe(), "policies": parts, "grace_seconds": grace_seconds,
            "interval_seconds": interval_seconds}
