"""Concurrent catalog transactions, in one process, on SQLite and PostgreSQL.

The commit transaction reads the run's last-good, decides, and moves it. SQLite serializes
such transactions (BEGIN IMMEDIATE); PostgreSQL at READ COMMITTED does not, so the domain
code locks the run row (SELECT ... FOR UPDATE) before it reads last-good. The rendezvous
test forces the interleaving that loses I3 without that lock, on a real PostgreSQL server,
and shows it both ways: the service's engine keeps last-good on the newest step; the
control, the same engine with FOR UPDATE taken out of every statement, moves it back.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from sqlalchemy import event, func, select

from lastgood_service.blobstore import MemoryBlobStore
from lastgood_service.catalog.db import make_engine, make_sessionmaker, upgrade_head
from lastgood_service.catalog.models import Checkpoint, Event, Run
from lastgood_service.domain.commit import CommitService
from lastgood_service.settings import Settings
from tests.service.helpers import make_shard, shard_name

from .conftest import MIGRATIONS
from .test_commit_backends import ATTEMPT, last_good, put, save

HANG_GUARD = 60.0  # only against a hang; nothing here measures time


def wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def prepared(commits: CommitService, run: str, step: int, parent: int | None) -> int:
    """Begun and uploaded, not voted: one vote away from its commit."""
    cid = commits.begin(run, step, 1, parent, ATTEMPT).id
    put(commits, cid, 0, make_shard(0, seed=step))
    return cid


def commit_two_at_once(engine, pg_server, database: str) -> tuple[int, int, int | None]:
    """Commit steps 2 and 3 of one run from two threads. Each is held at the statement that
    moves last-good until the other one got there too, or is blocked on a lock; when both
    got there, the newer step goes first. Returns (older id, newer id, last-good after)."""
    sessions = make_sessionmaker(engine)
    commits = CommitService(Settings(commit_wait_max=0), sessions, MemoryBlobStore())
    base = save(commits, "race", 1)
    older = prepared(commits, "race", 2, base)
    newer = prepared(commits, "race", 3, base)
    arrived = {older: threading.Event(), newer: threading.Event()}
    done = {older: threading.Event(), newer: threading.Event()}
    role = threading.local()

    def someone_waits_for_a_lock() -> bool:
        with pg_server.connect(database) as c:
            return c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
                             (database,)).fetchone()[0] > 0

    def hold(conn, cursor, statement, params, context, executemany):
        me = getattr(role, "cid", None)
        if me is None or not statement.lstrip().upper().startswith("UPDATE RUNS SET LAST_GOOD_ID"):
            return
        other = newer if me == older else older
        arrived[me].set()
        wait_until(lambda: arrived[other].is_set() or someone_waits_for_a_lock(), "the other commit")
        if me == older and arrived[other].is_set():
            wait_until(done[other].is_set, "the newer commit to finish")

    event.listen(engine, "before_cursor_execute", hold)
    errors: list[BaseException] = []

    def vote(cid: int) -> None:
        role.cid = cid
        try:
            assert commits.vote(cid, 0, [shard_name(0)]).status == "COMMITTED"
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            done[cid].set()

    threads = [threading.Thread(target=vote, args=(cid,)) for cid in (older, newer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD * 3)
    event.remove(engine, "before_cursor_execute", hold)
    assert not errors, errors
    with sessions() as s:
        assert s.get(Checkpoint, newer).status == s.get(Checkpoint, older).status == "COMMITTED"
    return older, newer, last_good(sessions, "race")


def test_concurrent_commits_of_one_run_keep_last_good_on_the_newest_postgres(pg_server, pg_url):
    upgrade_head(pg_url, MIGRATIONS)
    engine = make_engine(pg_url)
    try:
        older, newer, lg = commit_two_at_once(engine, pg_server, pg_url.rsplit("/", 1)[1])
    finally:
        engine.dispose()
    assert lg == newer


_FOR_UPDATE = re.compile(r"\s+FOR\s+(NO\s+KEY\s+)?UPDATE(\s+OF\s+\S+)?(\s+NOWAIT|\s+SKIP\s+LOCKED)?", re.I)


def test_control_without_row_locks_postgres_moves_last_good_back(pg_server, pg_url):
    """CONTROL: the same interleaving with FOR UPDATE stripped from every statement (so the
    commit reads last-good unlocked, as commit.py once did) leaves last-good on the older
    step though the newer one committed: the lost update the row lock prevents."""
    upgrade_head(pg_url, MIGRATIONS)
    engine = make_engine(pg_url)
    stripped = []

    def no_row_locks(conn, cursor, statement, params, context, executemany):
        new = _FOR_UPDATE.sub("", statement)
        if new != statement:
            stripped.append(statement)
        return new, params

    event.listen(engine, "before_cursor_execute", no_row_locks, retval=True)
    try:
        older, newer, lg = commit_two_at_once(engine, pg_server, pg_url.rsplit("/", 1)[1])
    finally:
        engine.dispose()
    assert any("FROM runs" in st for st in stripped), "the commit no longer locks the run row this way"
    assert lg == older, "without the row lock the older commit overwrites last-good"


def test_many_threads_commit_different_runs_and_ranks_of_one_checkpoint(commits, sessions):
    """Free-running threads (no forced interleaving): 4 runs x 3 steps x 2 ranks, every rank
    its own thread. Each checkpoint commits exactly once, and last-good ends on the newest."""
    runs = [f"many-{i}" for i in range(4)]
    world, steps = 2, 3
    barrier = threading.Barrier(len(runs) * world)
    errors: list[BaseException] = []

    def rank_loop(run: str, rank: int) -> None:
        try:
            barrier.wait(HANG_GUARD)
            parent = None
            for step in range(1, steps + 1):
                cid = commits.begin(run, step, world, parent, ATTEMPT, rank=rank).id
                put(commits, cid, rank, make_shard(rank, seed=step))
                res = commits.vote(cid, rank, [shard_name(rank)], wait_seconds=2)
                deadline = time.monotonic() + HANG_GUARD
                while res.status != "COMMITTED" and time.monotonic() < deadline:
                    res = commits.vote(cid, rank, [shard_name(rank)], wait_seconds=2)
                assert res.status == "COMMITTED", res
                parent = cid
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rank_loop, args=(run, r)) for run in runs for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD * 3)
    assert not errors, errors
    with sessions() as s:
        for run in runs:
            r = s.scalar(select(Run).where(Run.name == run))
            cks = list(s.scalars(select(Checkpoint).where(Checkpoint.run_id == r.id).order_by(Checkpoint.step)))
            assert [(c.step, c.status) for c in cks] == [(st, "COMMITTED") for st in range(1, steps + 1)]
            assert r.last_good_id == cks[-1].id
            for c in cks:
                n = s.scalar(select(func.count()).select_from(Event)
                             .where(Event.checkpoint_id == c.id, Event.kind == "commit"))
                assert n == 1, (run, c.step, n)


def test_concurrent_begins_of_a_new_run_agree(commits, sessions):
    n = 6
    barrier = threading.Barrier(n)
    ids: list[int] = []
    errors: list[BaseException] = []

    def begin(rank: int) -> None:
        try:
            barrier.wait(HANG_GUARD)
            ids.append(commits.begin("fresh-run", 5, n, None, ATTEMPT, rank=rank).id)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=begin, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD)
    assert not errors, errors
    assert len(set(ids)) == 1 and len(ids) == n
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Run).where(Run.name == "fresh-run")) == 1
        assert s.scalar(select(func.count()).select_from(Event).where(Event.kind == "begin")) == 1


def test_sqlite_transactions_begin_immediate(tmp_path):
    """What makes SQLite safe without row locks: every transaction takes the write lock up
    front (FOR UPDATE does not exist there; SQLAlchemy leaves it out)."""
    url = f"sqlite:///{tmp_path / 'c.db'}"
    upgrade_head(url, MIGRATIONS)
    engine = make_engine(url)
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda c, cur, st, *a: seen.append(st))
    with make_sessionmaker(engine)() as s, s.begin():
        s.scalar(select(func.count()).select_from(Run))
    engine.dispose()
    assert any(st.strip().upper() == "BEGIN IMMEDIATE" for st in seen)
