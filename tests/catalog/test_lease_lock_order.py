"""Lease expiry locks checkpoint rows in id order, as vote batches do (domain/commit/votebatch.py).

A vote batch locks its checkpoints' rows in id order. If expire_leases updated the
expired ones in any other order (the order its query happened to return them: by lease,
or as the heap lies), a batch holding checkpoint a and wanting b, and expire_leases
holding b and wanting a, would deadlock on PostgreSQL, and PostgreSQL would fail one of
them: a whole batch of votes, of unrelated runs too. The test holds a's row lock (as a
batch would) and lets expire_leases run into it: it must be waiting for a while holding
nothing of b.
"""

from __future__ import annotations

import threading

from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from lastgood_service.blobstore import MemoryBlobStore
from lastgood_service.catalog.db import make_engine, make_sessionmaker, upgrade_head
from lastgood_service.domain.commit import CommitService
from lastgood_service.settings import Settings

from .conftest import MIGRATIONS, Clock
from .test_commit_backends import ATTEMPT
from .test_concurrency import wait_until


def waiting(conn) -> int:
    """Sessions of this database waiting for a lock (a fresh transaction each time: a
    transaction sees one snapshot of pg_stat_activity)."""
    try:
        return conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                 "AND datname = current_database()")).scalar()
    finally:
        conn.rollback()


def test_expire_leases_locks_checkpoints_in_id_order_postgres(pg_server, pg_url):
    upgrade_head(pg_url, MIGRATIONS)
    engine = make_engine(pg_url)
    clock = Clock()
    commits = CommitService(Settings(lease_seconds=60, commit_wait_max=0), make_sessionmaker(engine),
                            MemoryBlobStore(), clock=clock)
    a = commits.begin("run-a", 1, 1, None, ATTEMPT).id
    b = commits.begin("run-b", 1, 1, None, ATTEMPT).id
    assert a < b
    clock.advance(5)
    commits.renew(a)  # a's lease now ends after b's, and its row version lies after b's
    clock.advance(600)  # both leases ran out
    holder, prober = engine.connect(), engine.connect()
    expired: list[int] = []
    t = threading.Thread(target=lambda: expired.extend(commits.expire_leases()), daemon=True)
    try:
        holder.execute(text("SELECT id FROM checkpoints WHERE id = :a FOR UPDATE"), {"a": a})  # a batch holds a
        t.start()
        wait_until(lambda: waiting(prober) >= 1, "expire_leases to wait for a's row lock")  # within lock_timeout
        try:  # ... while holding nothing of b: the batch could lock b next
            prober.execute(text("SELECT id FROM checkpoints WHERE id = :b FOR UPDATE NOWAIT"), {"b": b})
            b_free = True
        except OperationalError:
            b_free = False
        prober.rollback()
        assert b_free, "expire_leases holds b while it waits for a: a vote batch locking a then b deadlocks with it"
    finally:
        prober.rollback()
        holder.rollback()
        if t.is_alive() or t.ident:
            t.join(60)
        holder.close()
        prober.close()
        engine.dispose()
    assert sorted(expired) == [a, b]
