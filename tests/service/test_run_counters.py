"""Per-run counters (run_stats, migration 0007) equal a full recount of the checkpoints
after every kind of change a real service makes: begins, commits, aborts, expiry,
corruption found by verify, a rollback, GC. The runs list and the overview read them."""

from __future__ import annotations

import sqlite3

import pytest

from tests.service.helpers import Client, http, shard_blob, wait_status

pytestmark = pytest.mark.slow  # a mixed workload with lease expiry and GC

STATUSES = ("PENDING", "COMMITTED", "ABANDONED", "CORRUPT", "DELETED")
RECOUNT = """SELECT runs.name, c.status, count(c.id), coalesce(sum(c.bytes), 0), max(c.step)
             FROM runs LEFT JOIN checkpoints c ON c.run_id = runs.id GROUP BY runs.name, c.status"""
STORED = """SELECT runs.name, s.pending, s.committed, s.abandoned, s.corrupt, s.deleted, s.bytes_stored,
                   s.newest_step FROM runs JOIN run_stats s ON s.run_id = runs.id"""


def _catalog(svc) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{svc.data_dir / 'catalog.db'}?mode=ro", uri=True)


def recount(svc) -> dict[str, dict]:
    """Counted from the checkpoints themselves, as the runs list did before run_stats."""
    out: dict[str, dict] = {}
    with _catalog(svc) as db:
        for name, status, n, nbytes, step in db.execute(RECOUNT):
            run = out.setdefault(name, {"checkpoints": dict.fromkeys(STATUSES, 0), "bytes_stored": 0,
                                        "newest_step": None})
            if status is None:
                continue
            run["checkpoints"][status] = n
            run["bytes_stored"] += nbytes if status != "DELETED" else 0
            run["newest_step"] = max(step, run["newest_step"] if run["newest_step"] is not None else step)
    return out


def stored(svc) -> dict[str, dict]:
    with _catalog(svc) as db:
        return {name: {"checkpoints": dict(zip(STATUSES, row[:5])), "bytes_stored": row[5], "newest_step": row[6]}
                for name, *row in db.execute(STORED)}


def served(svc) -> dict[str, dict]:
    """What the overview and the runs list answer."""
    h = http(svc)
    runs = {r["name"]: r["checkpoints"] for r in h.get("/api/v1/runs", params={"limit": 1000}).json()["items"]}
    out = {}
    for r in h.get("/api/v1/overview", params={"limit": 1000}).json()["items"]:
        assert runs[r["name"]] == r["checkpoints"]
        out[r["name"]] = {"checkpoints": r["checkpoints"], "bytes_stored": r["bytes_stored"],
                          "newest_step": r["newest_step"]}
    return out


def check(svc, phase: str) -> None:
    truth = recount(svc)
    assert stored(svc) == truth, phase
    assert served(svc) == truth, phase


def test_run_counters_equal_a_recount_through_a_mixed_workload(make_service, run_name):
    svc = make_service(LASTGOOD_RETENTION="latest:1,tagged,last-good,branch-heads", LASTGOOD_GC_INTERVAL="0",
                       LASTGOOD_GC_GRACE_SECONDS="0")
    h = http(svc)
    a, b = f"{run_name}-a", f"{run_name}-b"
    with Client(svc.grpc_target) as c:
        ids, parent = [], 0
        for step in (10, 20, 30, 40, 50):
            parent = c.save(a, step, world_size=2, parent_id=parent)[0]
            ids.append(parent)
        c.save(b, 5)
        check(svc, "commits")

        aborted = c.begin(a, 60, parent_id=parent).checkpoint_id
        c.abort(aborted)
        expiring = c.begin(b, 6).checkpoint_id  # no vote: the 3 s lease expires
        check(svc, "begin, abort")
        wait_status(svc, aborted, "ABANDONED")
        wait_status(svc, expiring, "ABANDONED")
        check(svc, "abort, expiry")

        blob = shard_blob(svc, ids[-1], 0)  # last-good's shard, damaged: verify marks it CORRUPT
        raw = bytearray(blob.read_bytes())
        raw[-3] ^= 0xFF
        blob.write_bytes(bytes(raw))
        assert h.post(f"/api/v1/checkpoints/{ids[-1]}/verify").json()["status"] == "CORRUPT"
        check(svc, "corruption")

        res = h.post(f"/api/v1/runs/{a}/rollback", json={"target_id": ids[1], "spike_step": 35})
        assert res.status_code == 200, res.text
        c.save(a, 30, parent_id=ids[1], attempt="after-rollback")
        check(svc, "rollback and a new branch")

        done = h.post("/api/v1/gc").json()["result"]
        assert done["deleted"]  # GC had something to delete: the counters saw DELETED come
        check(svc, "gc")
        c.save(b, 7)
        check(svc, "a commit after gc")
    counts = stored(svc)[a]["checkpoints"]
    assert counts["DELETED"] and counts["COMMITTED"] and counts["ABANDONED"] == 0  # GC took the abandoned one
