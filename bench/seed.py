"""A catalog of any size without a trainer: runs x checkpoints x ranks of rows, as a
service that has been running for a while would hold them (bench/catalog.py, tests).

    python -m bench.seed sqlite:////tmp/cat.db --runs 100 --checkpoints 1000 --ranks 8
    python -m bench.seed postgresql+psycopg://.../db --runs 100 --checkpoints 1000 --ranks 8

Each run is a chain of committed checkpoints (a step every 100), every rank with one
shard row and one vote, a `begin` and a `commit` event per checkpoint. GC has kept up:
all but the newest `keep` are DELETED with their `gc_delete` event (`--no-gc`: all stay
COMMITTED, GC's first pass has everything to do). No blobs are written: the store is
the blob benchmark's business (bench/run.py); GC deletes keys that are not there as a no-op.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time

from sqlalchemy import func, insert, select, update

from lastgood_service.catalog.db import make_engine, upgrade_head
from lastgood_service.catalog.models import COMMITTED, DELETED, VERIFIED, Checkpoint, Event, Run, Shard, Vote
from lastgood_service.domain import keys

from .common import ROOT

ROWS_PER_TX = 20_000
SHARD_BYTES = 64 * 1024 * 1024


def seed(url: str, runs: int = 100, checkpoints: int = 1000, ranks: int = 8, keep: int = 3, gc_done: bool = True,
         prefix: str = "seed", migrate: bool = True) -> dict:
    """Add `runs` runs to the catalog at url (migrated first); returns counts and seconds."""
    if migrate:
        upgrade_head(url, ROOT / "service/lastgood_service/migrations")
    engine = make_engine(url)
    t0 = time.perf_counter()
    now = dt.datetime.now(dt.timezone.utc)
    counts = {"runs": 0, "checkpoints": 0, "shards": 0, "votes": 0, "events": 0}
    try:
        with engine.begin() as c:
            next_ck = (c.scalar(select(func.max(Checkpoint.id))) or 0) + 1
            next_run = (c.scalar(select(func.max(Run.id))) or 0) + 1
        for r in range(runs):
            run_id, name = next_run + r, f"{prefix}-{next_run + r:05d}"
            start = now - dt.timedelta(seconds=checkpoints * 60)
            cks, shards, votes, events = [], [], [], []
            for i in range(checkpoints):
                cid, step = next_ck + i, i * 100
                at = start + dt.timedelta(seconds=i * 60)
                deleted = gc_done and i < checkpoints - keep
                attempt = "a0"
                cks.append({"id": cid, "run_id": run_id, "step": step, "attempt": attempt, "world_size": ranks,
                            "parent_id": cid - 1 if i else None, "status": DELETED if deleted else COMMITTED,
                            "bytes": ranks * SHARD_BYTES, "lease_expires_at": at, "created_at": at,
                            "committed_at": at + dt.timedelta(seconds=5),
                            "manifest_key": keys.manifest_key(keys.prefix(cid, name, step, attempt)),
                            "manifest_hash": "0" * 32, "deleted_at": at + dt.timedelta(seconds=180) if deleted else None,
                            "generation": 1})
                pre = keys.prefix(cid, name, step, attempt)
                digest = f"{cid:016x}{0:016x}"
                for rank in range(ranks):
                    shards.append({"checkpoint_id": cid, "rank": rank, "file_name": f"rank{rank:05d}.safetensors",
                                   "size": SHARD_BYTES, "xxh3_128": digest, "blob_key": keys.shard_key(pre, rank, digest),
                                   "status": VERIFIED, "index_json": None, "created_at": at})
                    votes.append({"checkpoint_id": cid, "rank": rank,
                                  "files_json": json.dumps([f"rank{rank:05d}.safetensors"]), "created_at": at})
                events.append({"run_id": run_id, "checkpoint_id": cid, "kind": "begin", "at": at,
                               "data_json": json.dumps({"step": step, "world_size": ranks, "attempt": attempt})})
                events.append({"run_id": run_id, "checkpoint_id": cid, "kind": "commit",
                               "at": at + dt.timedelta(seconds=5),
                               "data_json": json.dumps({"step": step, "bytes": ranks * SHARD_BYTES})})
                if deleted:
                    events.append({"run_id": run_id, "checkpoint_id": cid, "kind": "gc_delete",
                                   "at": at + dt.timedelta(seconds=180),
                                   "data_json": json.dumps({"step": step, "reason": "not kept by the retention policy",
                                                            "was": COMMITTED})})
            with engine.begin() as c:
                c.execute(insert(Run), [{"id": run_id, "name": name, "created_at": start, "generation": 1}])
                for table, rows in ((Checkpoint, cks), (Shard, shards), (Vote, votes), (Event, events)):
                    for i in range(0, len(rows), ROWS_PER_TX):
                        c.execute(insert(table), rows[i:i + ROWS_PER_TX])
                c.execute(update(Run).where(Run.id == run_id).values(last_good_id=next_ck + checkpoints - 1))
            next_ck += checkpoints
            for k, rows in (("checkpoints", cks), ("shards", shards), ("votes", votes), ("events", events)):
                counts[k] += len(rows)
            counts["runs"] += 1
        if engine.dialect.name == "postgresql":
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
                c.exec_driver_sql("ANALYZE")
                # explicit ids above: move the sequences past them
                for table in ("runs", "checkpoints", "shards", "events"):
                    c.exec_driver_sql(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                                      f"(SELECT coalesce(max(id), 1) FROM {table}))")
        else:
            with engine.begin() as c:
                c.exec_driver_sql("ANALYZE")
    finally:
        engine.dispose()
    return {**counts, "seconds": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--checkpoints", type=int, default=1000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--no-gc", action="store_true", help="leave every checkpoint COMMITTED")
    a = ap.parse_args()
    print(json.dumps(seed(a.url, a.runs, a.checkpoints, a.ranks, a.keep, not a.no_gc)))


if __name__ == "__main__":
    main()
