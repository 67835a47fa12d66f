"""The last of a checkpoint's peer checks commits it, whoever does it (domain/peer/peer_fallback.py).

Two parties turn DECLARED files VERIFIED: a rank's report (under the checkpoint's row lock)
and the service's own background hash. Each commits if it saw no DECLARED file left. If the
background hash marked its file without the row lock, on PostgreSQL it could run while a
report held the lock: the report sees the background's file still DECLARED (so it skips the
commit), the background's try_commit does not see the report's uncommitted file (so it
commits nothing) - nobody commits and the lease runs out. The test drives the report's
transaction by hand: it holds the row lock and marks F1, while the background marks F2 and
tries the commit; then the report's transaction commits. The checkpoint must commit.
"""

from __future__ import annotations

import threading

from sqlalchemy import text

from lastgood_service.blobstore import MemoryBlobStore
from lastgood_service.catalog.db import make_engine, make_sessionmaker, upgrade_head
from lastgood_service.domain.peer import peer_fallback
from lastgood_service.domain.commit import CommitService
from lastgood_service.settings import Settings
from tests.service.helpers import make_shard

from .conftest import MIGRATIONS
from .test_commit_backends import ATTEMPT, put, status
from .test_concurrency import wait_until
from .test_lease_lock_order import waiting


def test_background_hash_and_report_racing_still_commit_postgres(pg_server, pg_url):
    upgrade_head(pg_url, MIGRATIONS)
    engine = make_engine(pg_url)
    sessions = make_sessionmaker(engine)
    commits = CommitService(Settings(lease_seconds=60, commit_wait_max=0), sessions, MemoryBlobStore())
    cid = commits.begin("run-peer", 1, 1, None, ATTEMPT).id
    put(commits, cid, 0, make_shard(0, seed=1), name="f1.safetensors")
    put(commits, cid, 0, make_shard(0, seed=2), name="f2.safetensors")
    with engine.begin() as conn:  # as a peer-checked hand-over records them
        conn.execute(text("UPDATE shards SET status = 'DECLARED' WHERE checkpoint_id = :c"), {"c": cid})
    assert commits.vote(cid, 0, ["f1.safetensors", "f2.safetensors"]).status == "PENDING"

    fb = peer_fallback.PeerFallback(commits)
    committed: list[bool] = []

    def background():  # what PeerFallback._run does once f2's bytes hashed right
        fb._mark_verified(cid, 0, "f2.safetensors")
        committed.append(commits.try_commit(cid))

    report, prober = engine.connect(), engine.connect()
    t = threading.Thread(target=background, daemon=True)
    try:
        # the report: row lock, f1 VERIFIED; f2 is still DECLARED, so it would not try the commit
        report.execute(text("SELECT id FROM checkpoints WHERE id = :c FOR UPDATE"), {"c": cid})
        report.execute(text("UPDATE shards SET status = 'VERIFIED' WHERE checkpoint_id = :c "
                            "AND file_name = 'f1.safetensors'"), {"c": cid})
        assert report.execute(text("SELECT count(*) FROM shards WHERE checkpoint_id = :c AND status = 'DECLARED'"),
                              {"c": cid}).scalar() == 1
        t.start()
        wait_until(lambda: not t.is_alive() or waiting(prober) >= 1, "the background to finish or wait for the lock")
        report.commit()
        t.join(60)
    finally:
        report.rollback()
        prober.rollback()
        report.close()
        prober.close()
    assert status(sessions, cid) == "COMMITTED", (
        f"nobody committed: the background's try_commit returned {committed} while the report held the lock")
    engine.dispose()
