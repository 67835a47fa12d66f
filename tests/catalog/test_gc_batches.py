"""GC at scale on each backend (domain/gc/): passes plan only runs where something
changed, execution marks checkpoints in short bounded transactions that commits run
between, and I4 holds while tags, leases and saves race a batched pass.

Bounds come from the catalog's own transaction timings (catalog/txtimer.py), never
from a wall clock around a whole pass.
"""

from __future__ import annotations

import threading

from sqlalchemy import func, select

from bench.seed import seed
from lastgood_service.catalog import txtimer
from lastgood_service.catalog.db import read_sessionmaker
from lastgood_service.catalog.models import DELETED, PENDING, Checkpoint, Event, ReadLease, Run, Tag
from lastgood_service.domain.runs.curation import Curator
from lastgood_service.domain.errors import FailedPrecondition
from lastgood_service.domain.gc import GarbageCollector
from lastgood_service.domain.runs.retention import Retention

from tests.service.helpers import make_shard, shard_name

from .test_commit_backends import put, save

POLICY = Retention.parse("latest:3,tagged,last-good,branch-heads")
HANG_GUARD = 120.0


def collector(sessions, blobs, clock, batch_size=20, **kw) -> GarbageCollector:
    return GarbageCollector(sessions, blobs, POLICY, 3600, clock=clock, batch_size=batch_size, **kw)


def gc_deletes(sessions, run: str = "seed-00001") -> list[int]:
    with sessions() as s:
        return list(s.scalars(select(Event.id).join(Run, Run.id == Event.run_id)
                              .where(Event.kind == "gc_delete", Run.name == run).order_by(Event.id)))


def commit_events(sessions, run: str) -> list[int]:
    with sessions() as s:
        return list(s.scalars(select(Event.id).join(Run, Run.id == Event.run_id)
                              .where(Event.kind == "commit", Run.name == run).order_by(Event.id)))


def _saves_during(commits, run: str, during) -> list[int]:
    """Save one checkpoint after another on `run` while `during()` runs; the ids saved."""
    stop, saved, errors = threading.Event(), [], []

    def saver():
        parent = None
        try:
            with txtimer.labelled("save"):
                while not stop.is_set():
                    parent = save(commits, run, len(saved), parent=parent)
                    saved.append(parent)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=saver, daemon=True)
    t.start()
    try:
        while not saved and not errors and t.is_alive():
            t.join(0.05)  # the saves are under way before the pass starts
        during()
    finally:
        stop.set()
        t.join(HANG_GUARD)
    assert not errors, errors
    return saved


def _batched_pass_while_saving(catalog_url, sessions, commits, blobs, clock, batch_size):
    seed(catalog_url, runs=1, checkpoints=300, ranks=2, gc_done=False, migrate=False)
    gc = collector(sessions, blobs, clock, batch_size=batch_size)
    timer = txtimer.of(sessions)
    mark = timer.total
    result = {}
    saved = _saves_during(commits, "live", lambda: result.update(gc.execute(gc.plan(full=False))))
    return gc, result, saved, timer.since(mark)


def test_gc_executes_in_batches_while_saves_commit(catalog_url, sessions, commits, blobs, clock):
    gc, result, saved, txs = _batched_pass_while_saving(catalog_url, sessions, commits, blobs, clock, batch_size=20)
    assert len(result["deleted"]) >= 300 - 3 and not result["skipped"]
    gc_holds = [t.hold for t in txs if t.label == "gc" and not t.read_only]  # planning reads: no write lock
    batches = -(-len(result["deleted"]) // 20)
    assert len(gc_holds) >= batches  # each batch its own transaction
    # commits ran between GC's batches: a commit event lies between the run's first and last deletion
    deletions = gc_deletes(sessions)
    assert any(deletions[0] < c < deletions[-1] for c in commit_events(sessions, "live")), \
        "no save committed while the pass was deleting"
    # no save waited for the write lock longer than GC held it in all: it never waited for the pass
    # (the domain labels a save's transactions itself: begin, put, vote...; all but GC's are the saver's)
    save_waits = [t.wait for t in txs if t.label != "gc" and not t.read_only]
    assert save_waits and max(save_waits) < sum(gc_holds)
    with sessions() as s:  # the saves of the live run are whole: latest:3 of them stay
        assert s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.status == PENDING)) <= 1


def test_control_one_transaction_pass_shuts_commits_out_sqlite(tmp_path):
    """CONTROL: with a batch as large as the plan (the pass as one transaction), on SQLite
    no commit lands between the pass's first and last deletion."""
    from lastgood_service.blobstore import MemoryBlobStore
    from lastgood_service.catalog.db import make_engine, make_sessionmaker, upgrade_head
    from lastgood_service.domain.commit import CommitService
    from lastgood_service.settings import Settings

    from .conftest import MIGRATIONS, Clock

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    upgrade_head(url, MIGRATIONS)
    engine = make_engine(url)
    try:
        sessions, blobs, clock = make_sessionmaker(engine), MemoryBlobStore(), Clock()
        commits = CommitService(Settings(lease_seconds=60, commit_wait_max=2), sessions, blobs, clock=clock)
        gc, result, saved, txs = _batched_pass_while_saving(url, sessions, commits, blobs, clock, batch_size=10_000)
        deletions = gc_deletes(sessions)
        assert len(deletions) == 300 - 3
        assert not any(deletions[0] < c < deletions[-1] for c in commit_events(sessions, "live"))
    finally:
        engine.dispose()


def test_i4_holds_while_tags_leases_and_saves_race_a_batched_pass(catalog_url, sessions, commits, blobs, clock):
    seed(catalog_url, runs=1, checkpoints=200, ranks=2, gc_done=False, migrate=False, prefix="race")
    gc = collector(sessions, blobs, clock, batch_size=10)
    plan = gc.plan(full=False)
    targets = [d.checkpoint_id for d in plan.checkpoints]
    curator = Curator(sessions)
    protected: list[int] = []
    done = threading.Event()

    def racer():
        for i, cid in enumerate(reversed(targets)):  # from the end GC reaches last
            if done.is_set():
                break
            try:
                if i % 2:
                    curator.set_tag(cid, "keep")
                else:
                    curator.acquire_lease(cid, "reader", 600)
                protected.append(cid)
            except FailedPrecondition:  # GC got there first: it is DELETED, so nothing to protect
                pass

    t = threading.Thread(target=racer, daemon=True)
    t.start()
    result = {}
    _saves_during(commits, "race-00001", lambda: result.update(gc.execute(plan)))
    done.set()
    t.join(HANG_GUARD)
    assert protected, "the racer protected nothing: the race did not happen"
    with sessions() as s:
        deleted = set(s.scalars(select(Checkpoint.id).where(Checkpoint.status == DELETED)))
        tagged = set(s.scalars(select(Tag.checkpoint_id).where(Tag.kind.in_(("tag", "alias", "pin")))))
        leased = set(s.scalars(select(ReadLease.checkpoint_id)))
        runs = list(s.scalars(select(Run)))
        last_good = {r.last_good_id for r in runs}
    assert not deleted & set(protected)
    assert not deleted & (tagged | leased | last_good)
    assert set(result["skipped"]) <= set(protected)  # what it skipped, it skipped for a tag or a lease


def test_a_pass_plans_only_runs_where_something_changed(catalog_url, sessions, commits, blobs, clock):
    seed(catalog_url, runs=3, checkpoints=10, ranks=1, gc_done=False, migrate=False, prefix="quiet")
    gc = collector(sessions, blobs, clock)
    first = gc.plan(full=False)
    assert {m.run for m in first.runs} == {"quiet-00001", "quiet-00002", "quiet-00003"}
    gc.execute(first)
    gc.execute(gc.plan(full=False))  # its own gc_delete events: looked at once more, nothing to do
    assert gc.plan(full=False).runs == []  # nothing new anywhere: nothing planned
    assert {m.run for m in gc.plan(full=True).runs} == {"quiet-00001", "quiet-00002", "quiet-00003"}
    # a new save in one run; another run's own policy changes: those two, and only they
    with sessions() as s:
        parent = s.scalar(select(Run.last_good_id).where(Run.name == "quiet-00001"))
    save(commits, "quiet-00001", 10_000, parent=parent)
    with sessions() as s, s.begin():
        s.execute(Run.__table__.update().where(Run.name == "quiet-00002").values(retention="latest:1,last-good,branch-heads"))
    plan = gc.plan(full=False)
    assert {m.run for m in plan.runs} == {"quiet-00001", "quiet-00002"}
    by_run = {}
    for d in plan.checkpoints:
        by_run.setdefault(d.run, []).append(d.step)
    assert len(by_run["quiet-00001"]) == 1 and len(by_run["quiet-00002"]) == 2  # latest:3 -> latest:1
    gc.execute(plan)
    assert gc.plan(full=False).runs != [] and gc.execute(gc.plan(full=False))["deleted"] == []
    assert gc.plan(full=False).runs == []


def test_time_alone_brings_a_run_back_when_a_lease_or_grace_period_ends(catalog_url, sessions, commits, blobs, clock):
    seed(catalog_url, runs=1, checkpoints=5, ranks=1, gc_done=False, migrate=False, prefix="lease")
    gc = collector(sessions, blobs, clock)
    with sessions() as s:
        oldest = s.scalar(select(func.min(Checkpoint.id)))
    Curator(sessions, clock=clock).acquire_lease(oldest, "reader", 60)
    gc.execute(gc.plan(full=False))
    assert gc.execute(gc.plan(full=False))["deleted"] == []
    assert gc.plan(full=False).runs == []  # leased: nothing changes until the lease ends
    clock.advance(61)
    plan = gc.plan(full=False)
    assert [d.checkpoint_id for d in plan.checkpoints] == [oldest]


def test_events_of_long_deleted_checkpoints_go_but_their_gc_delete(catalog_url, sessions, commits, blobs, clock):
    seed(catalog_url, runs=1, checkpoints=6, ranks=2, gc_done=False, migrate=False, prefix="old")
    gc = collector(sessions, blobs, clock, event_retention_seconds=3600)
    gc.execute(gc.plan(full=False))
    with sessions() as s:
        deleted = list(s.scalars(select(Checkpoint.id).where(Checkpoint.status == DELETED)))
    assert len(deleted) == 3
    assert gc.execute(gc.plan(full=False))["events_pruned"] == 0  # not yet an hour
    clock.advance(3601)
    plan = gc.plan(full=False)
    assert sorted(plan.events_of) == deleted
    assert gc.execute(plan)["events_pruned"] == 2 * 3  # begin and commit of each
    with sessions() as s:
        kinds = list(s.scalars(select(Event.kind).where(Event.checkpoint_id.in_(deleted))))
    assert kinds == ["gc_delete"] * 3


def test_event_rows_grow_with_checkpoints_not_ranks(sessions, commits):
    """One `begin` event per checkpoint, carrying the rank count, however many ranks begin
    it; a commit adds one `commit` event (docs/operations.md sizes the catalog by this)."""
    for rank in range(8):  # every rank begins the save, as the client's ranks do
        cid = commits.begin("wide", 1, 8, None, "attempt-1", rank=rank).id
    for rank in range(8):
        put(commits, cid, rank, make_shard(rank))
    assert [commits.vote(cid, rank, [shard_name(rank)]).status for rank in range(8)][-1] == "COMMITTED"
    with sessions() as s:
        rows = list(s.execute(select(Event.kind, Event.data_json).order_by(Event.id)))
    assert [k for k, _ in rows] == ["begin", "commit"]
    assert '"world_size": 8' in rows[0][1]


def test_a_pass_over_quiet_runs_writes_nothing(catalog_url, engine, sessions, commits, blobs, clock):
    """GC's bookkeeping (runs.gc_*) is written only where it changed: a full pass over runs
    where nothing happened takes no write transaction (on PostgreSQL each rewrote every run
    row, locking it against the begins and commits of that run)."""
    seed(catalog_url, runs=3, checkpoints=10, ranks=1, gc_done=True, migrate=False, prefix="quiet")
    gc = collector(sessions, blobs, clock, read_sessions=read_sessionmaker(engine))  # as main.py wires it
    gc.execute(gc.plan(full=True))  # the first pass writes each run's marks
    timer = txtimer.of(sessions)
    mark = timer.total
    plan = gc.plan(full=True)
    assert len(plan.runs) == 3 and not plan.checkpoints
    gc.execute(plan)
    assert [t for t in timer.since(mark, "gc") if not t.read_only] == []
    save(commits, "quiet-00002", 10_000)  # control: a run with something new gets its mark written
    mark = timer.total
    gc.execute(gc.plan(full=True))
    assert [t for t in timer.since(mark, "gc") if not t.read_only]
