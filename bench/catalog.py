"""The catalog at scale (issue 20): GC passes, the longest write transaction, save -> commit
with GC running and not, and the page's queries, on SQLite and PostgreSQL.

    python -m bench.catalog                       # 100 runs x 1,000 checkpoints x 8 ranks, both catalogs
    python -m bench.catalog --runs 10 --checkpoints 100 --saves 20 --out /tmp/x   # a smoke run
    python -m bench.catalog --seeded /var/tmp/lg-seeded --only-queries   # the page's queries again, in minutes

`--seeded DIR` keeps a pristine copy of each seeded catalog in DIR (the SQLite file, the
PostgreSQL data directory) and starts every later run with the same sizes from a copy of
it, so a run no longer pays the seeding (30-60 s a catalog); `--only-queries` skips the GC
passes and the saves and times the page's and the CLI's queries alone (the seeded catalog
as it is: the queried run has its 1,000 seeded checkpoints, not the 80 saves more of a
full run).

The catalog is seeded (bench/seed.py): `--runs` runs of `--checkpoints` checkpoints of
`--ranks` ranks, GC having kept up in all but `--backlog` runs, whose checkpoints are all
still COMMITTED (GC's catch-up work). Saves go through the domain (CommitService) in this
process, every rank beginning, uploading a small shard and voting, as the client's ranks
do, into an in-memory blob store: what is measured is the catalog. "GC running" is a
thread doing full passes back to back (every run planned, every batch executed) while
the saves run: the worst case, where a scheduled pass runs once an hour. Blocks of saves
with GC on and off alternate; ratios are between figures of this one run. Transaction
times come from the catalog engine's own timer (catalog/txtimer.py); "write" transactions
are those that take SQLite's write lock (queries and GC's planning read without it).
Once the domain is built, its objects are frozen out of Python's cyclic garbage collector
as the service's start-up does (pygc.py; `LASTGOOD_PYTHON_GC_FREEZE=false`: not).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc as python_gc
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from lastgood.wire.hashing import hash_bytes
from lastgood_service import pygc
from lastgood_service.blobstore import MemoryBlobStore
from lastgood_service.catalog import txtimer
from lastgood_service.catalog.db import alembic_config, make_engine, make_sessionmaker, read_sessionmaker
from lastgood_service.domain.commit import CommitService
from lastgood_service.domain.commit.types import ShardHeader
from lastgood_service.domain.gc import GarbageCollector
from lastgood_service.domain.queries import MAX_LINEAGE, Queries
from lastgood_service.domain.runs.retention import Retention
from lastgood_service.settings import Settings

from .common import ROOT
from .seed import seed

POLICY = "latest:3,tagged,last-good,branch-heads"
PAGE_EVENT_KINDS = ["spike", "rollback", "restart", "launch", "fenced", "corrupt", "abort", "expired"]
_SHARDS: dict[int, tuple[bytes, str]] = {}


def shard(rank: int) -> tuple[bytes, str]:
    """A small valid shard file of this rank (the tests' maker: one definition of one)."""
    if rank not in _SHARDS:
        from tests.service.helpers import make_shard

        data = make_shard(rank)
        _SHARDS[rank] = (data, hash_bytes(data))
    return _SHARDS[rank]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else 0.0


def _ms(x: float) -> float:
    return round(x * 1000, 2)


class FullCollections:
    """Python's generation-2 collections while the bench runs (gc.callbacks): how many, the longest."""

    def __init__(self) -> None:
        self.count, self.longest, self._began = 0, 0.0, {}

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began[threading.get_ident()] = time.perf_counter()
        elif (t0 := self._began.pop(threading.get_ident(), None)) is not None:
            self.count += 1
            self.longest = max(self.longest, time.perf_counter() - t0)


def save_once(commits: CommitService, run: str, step: int, ranks: int, parent: int | None) -> tuple[int, float]:
    t0 = time.perf_counter()
    cid = 0
    for r in range(ranks):
        cid = commits.begin(run, step, ranks, parent, "bench", rank=r).id
    for r in range(ranks):
        name = f"rank{r:05d}.safetensors"
        data, digest = shard(r)
        commits.put_shard(ShardHeader(cid, r, name, len(data), digest), [data])
    for r in range(ranks):
        res = commits.vote(cid, r, [f"rank{r:05d}.safetensors"])
    assert res.status == "COMMITTED", res
    return cid, time.perf_counter() - t0


def seed_catalog(url: str, runs: int, checkpoints: int, ranks: int, backlog: int) -> dict:
    """`runs` runs, GC having kept up with all but `backlog` of them."""
    done = seed(url, runs=runs - backlog, checkpoints=checkpoints, ranks=ranks, gc_done=True, prefix="kept")
    behind = seed(url, runs=backlog, checkpoints=checkpoints, ranks=ranks, gc_done=False, prefix="behind",
                  migrate=False) if backlog else {}
    return {"kept_up": done, "backlog": behind}


SEEDED = "seeded.json"  # beside a pristine catalog: what it is (stamp) and what seeding it took


def stamp(sizes: tuple[int, ...]) -> dict:
    """What a kept catalog must match to be reused: its sizes, the migrations' head and the
    seeder (a catalog kept before a new migration or seeder is seeded again)."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("sqlite://", ROOT / "service/lastgood_service/migrations")).get_current_head()
    seeder = hashlib.sha256((ROOT / "bench" / "seed.py").read_bytes()).hexdigest()[:16]
    return {"sizes": list(sizes), "migrations_head": head, "seeder": seeder}


def _pristine(where: Path, sizes: tuple[int, ...]) -> dict | None:
    info = where / SEEDED
    if info.exists() and (got := json.loads(info.read_text())).get("stamp") == stamp(sizes):
        return got
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    return None


def pristine_sqlite(where: Path, sizes: tuple[int, ...]) -> dict:
    """A seeded SQLite catalog of these sizes at where/catalog.db, seeded now if not there."""
    if (got := _pristine(where, sizes)) is None:
        got = {"stamp": stamp(sizes), "seed": seed_catalog(f"sqlite:///{where / 'catalog.db'}", *sizes)}
        (where / SEEDED).write_text(json.dumps(got))  # last: a seeding cut short is seeded again
    return got


def pg_root() -> Path:
    """A directory the tests' PostgreSQL server may live in (it runs as `postgres` under root)."""
    root = Path(tempfile.mkdtemp(prefix="lg-bench-pg-"))
    if os.geteuid() == 0:
        import pwd

        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    return root


def pristine_postgresql(where: Path, sizes: tuple[int, ...]) -> dict:
    """A seeded PostgreSQL data directory of these sizes at where/data (server stopped),
    seeded now if not there; later runs start a server on a copy of it."""
    from tests.pg import PG_BIN, _as_postgres, _start

    if (got := _pristine(where, sizes)) is not None:
        return got
    root = pg_root()
    server = _start(root)
    try:
        database = server.create_database("bench")
        got = {"stamp": stamp(sizes), "database": database, "seed": seed_catalog(server.url(database), *sizes)}
    finally:
        _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(server.data_dir), "-m", "fast", "-w", "stop")
    subprocess.run(["cp", "-a", str(root / "data"), str(where / "data")], check=True)
    shutil.rmtree(root, ignore_errors=True)
    (where / SEEDED).write_text(json.dumps(got))
    return got


def bench_catalog(url: str, runs: int, checkpoints: int, ranks: int, backlog: int, saves: int, block: int,
                  query_reps: int, batch_size: int, seeded: dict | None = None, only_queries: bool = False) -> dict:
    """`seeded`: the catalog at url is a copy of a pristine one (its seeded.json)."""
    out: dict = {"url": url.split("://")[0], "runs": runs, "checkpoints_per_run": checkpoints, "ranks": ranks,
                 "only_queries": only_queries}
    out["seed"] = {**seeded["seed"], "copy_of_kept": True} if seeded else seed_catalog(url, runs, checkpoints, ranks, backlog)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    timer = txtimer.of(sessions)
    blobs = MemoryBlobStore()
    settings = Settings(lease_seconds=300, commit_wait_max=5)
    commits = CommitService(settings, sessions, blobs)
    reads = read_sessionmaker(engine)  # as the service wires them (main.py)
    gc = GarbageCollector(sessions, blobs, Retention.parse(POLICY), 3600, batch_size=batch_size, read_sessions=reads)
    queries = Queries(reads)
    for r in range(ranks):  # the shards' maker imported and run: the bench's own start-up, frozen with the rest
        shard(r)
    out["python_gc_frozen_objects"] = pygc.freeze_startup(settings)  # start-up done, as the service's main()
    collections = FullCollections()
    python_gc.callbacks.append(collections)
    try:
        if not only_queries:
            out.update(gc_and_saves(gc, commits, timer, ranks, saves, block))
        # ---- the page's and the CLI's queries
        run = "kept-00002"
        views = {
            "overview (100 runs)": lambda: queries.overview(limit=100),
            "runs list (100 runs)": lambda: queries.list_runs(limit=100),
            # the REST answer's JSON text, as the route sends it (domain/runs/lineage.py)
            "lineage (a whole run)": lambda: queries.lineage_json(run, limit=MAX_LINEAGE),
            "lineage page (200)": lambda: queries.lineage_json(run, limit=200, offset=400),
            "events by kind (the page)": lambda: queries.events(run, kinds=PAGE_EVENT_KINDS, limit=1000),
            "events (100)": lambda: queries.events(run, limit=100),
            "checkpoints by status": lambda: queries.list_checkpoints(run, status="COMMITTED"),
        }
        q = {}
        for name, fn in views.items():
            fn()
            xs, cpu = [], []
            full = collections.count
            for _ in range(query_reps):
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                xs.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            # cpu: this thread's CPU (SQLite works in it): what the query costs whatever the load
            q[name] = {"p50_ms": _ms(pct(xs, 50)), "p99_ms": _ms(pct(xs, 99)), "cpu_p50_ms": _ms(pct(cpu, 50)),
                       "cpu_p99_ms": _ms(pct(cpu, 99)), "max_ms": _ms(max(xs, default=0)),
                       "python_full_collections": collections.count - full}  # Python's, during these calls
        out["queries"] = q
        writes = [r for r in timer.records if not r.read_only]
        out["longest_write_transaction_ms"] = _ms(max((r.hold for r in writes), default=0))
        out["longest_write_transaction_by"] = max(writes, key=lambda r: r.hold).label if writes else None
        out["python_full_collections"] = {"count": collections.count, "longest_ms": _ms(collections.longest)}
    finally:
        python_gc.callbacks.remove(collections)
        engine.dispose()
    return out


def gc_and_saves(gc: GarbageCollector, commits: CommitService, timer: txtimer.TxTimer, ranks: int, saves: int,
                 block: int) -> dict:
    """GC's three passes, then saves with GC running and not: the "gc" and "saves" figures."""
    out: dict = {}
    # ---- GC passes
    passes = {}
    for name, full in (("first full pass (catch-up of the backlog)", True),
                       ("incremental pass, nothing new", False), ("full pass, nothing to delete", True)):
        mark = timer.total
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = gc.plan(full=full)
        t1 = time.perf_counter()
        res = gc.execute(plan)
        t2, c2 = time.perf_counter(), time.thread_time()
        writes = [r for r in timer.since(mark, "gc") if not r.read_only]
        holds = [r.hold for r in writes]
        passes[name] = {"plan_s": round(t1 - t0, 3), "execute_s": round(t2 - t1, 3), "cpu_s": round(c2 - c0, 3),
                        "runs_planned": len(plan.runs), "deleted": len(res["deleted"]),
                        "write_transactions": len(holds),
                        "write_transaction_p50_ms": _ms(pct(holds, 50)), "write_transaction_p99_ms": _ms(pct(holds, 99)),
                        "longest_write_transaction_ms": _ms(max(holds, default=0)),
                        "first_write_transaction_ms": _ms(holds[0] if holds else 0),  # its first batch: the statements' first use
                        # its own CPU (SQLite: its SQL too): what it holds on a machine without other load
                        "longest_write_transaction_cpu_ms": _ms(max((r.cpu for r in writes), default=0))}
    out["gc"] = passes

    # ---- save -> commit, GC on and off in alternating blocks
    lat = {"off": [], "on": []}
    parents: dict[str, int | None] = {}
    stop = threading.Event()
    gc_busy = threading.Event()

    gc_cpu = {"passes": 0, "cpu_s": 0.0}  # the GC thread's own CPU: what it takes from the saves' process

    def gc_loop():
        while not stop.is_set():
            gc_busy.wait()
            if stop.is_set():
                break
            c0 = time.thread_time()
            gc.execute(gc.plan(full=True))
            gc_cpu["cpu_s"] += time.thread_time() - c0
            gc_cpu["passes"] += 1

    t = threading.Thread(target=gc_loop, daemon=True)
    t.start()
    mark = timer.total
    step = 10_000_000
    wall_on = 0.0
    for b in range(saves // block * 2):
        mode = "on" if b % 2 else "off"
        (gc_busy.set if mode == "on" else gc_busy.clear)()
        b0 = time.perf_counter()
        for i in range(block):
            run = f"kept-{1 + (i % 5):05d}"  # five of the kept-up runs: GC has them to plan again
            step += 1
            cid, seconds = save_once(commits, run, step, ranks, parents.get(run))
            parents[run] = cid
            lat[mode].append(seconds)
        if mode == "on":
            wall_on += time.perf_counter() - b0
    stop.set()
    gc_busy.set()
    t.join(120)
    all_tx = timer.since(mark)
    gc_writes = [r for r in all_tx if r.label == "gc" and not r.read_only]
    gc_holds = [r.hold for r in gc_writes]
    other = [r for r in all_tx if r.label != "gc" and not r.read_only]
    out["saves"] = {
        "saves_per_mode": len(lat["on"]),
        "p50_ms_gc_off": _ms(pct(lat["off"], 50)), "p99_ms_gc_off": _ms(pct(lat["off"], 99)),
        "p50_ms_gc_on": _ms(pct(lat["on"], 50)), "p99_ms_gc_on": _ms(pct(lat["on"], 99)),
        "p99_ratio_on_off": round(pct(lat["on"], 99) / pct(lat["off"], 99), 2),
        "gc_write_transactions_meanwhile": len(gc_holds),
        # back-to-back full passes while the GC-on blocks ran, and the share of one core they took
        "gc_passes_meanwhile": gc_cpu["passes"], "gc_cpu_share_of_gc_on_time": round(gc_cpu["cpu_s"] / max(wall_on, 1e-9), 2),
        "gc_write_transaction_p50_ms": _ms(pct(gc_holds, 50)), "gc_write_transaction_p99_ms": _ms(pct(gc_holds, 99)),
        "longest_gc_write_transaction_ms": _ms(max(gc_holds, default=0)),
        "longest_gc_write_transaction_cpu_ms": _ms(max((r.cpu for r in gc_writes), default=0)),
        "longest_save_write_transaction_ms": _ms(max((r.hold for r in other), default=0)),
        "longest_lock_wait_of_a_save_transaction_ms": _ms(max((r.wait for r in other), default=0)),
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--checkpoints", type=int, default=1000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--backlog", type=int, default=10, help="runs GC has not caught up with")
    ap.add_argument("--saves", type=int, default=200, help="saves with GC on, as many with it off")
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--query-reps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=Settings.model_fields["gc_batch_size"].default)
    ap.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    ap.add_argument("--seeded", type=Path, help="keep pristine seeded catalogs here and start from copies of them")
    ap.add_argument("--only-queries", action="store_true", help="no GC passes and saves: the page's queries alone")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    results = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "load_at_start": os.getloadavg()[0], "cpus": os.cpu_count(), "batch_size": a.batch_size}
    args = (a.runs, a.checkpoints, a.ranks, a.backlog, a.saves, a.block, a.query_reps, a.batch_size)
    sizes = (a.runs, a.checkpoints, a.ranks, a.backlog)
    kept = a.seeded / "x".join(map(str, sizes)) if a.seeded else None  # pristine copies of these sizes
    if a.backend in ("sqlite", "both"):
        d = Path(tempfile.mkdtemp(prefix="lg-bench-catalog-"))
        try:
            db, seeded = d / "catalog.db", None
            if kept is not None:
                seeded = pristine_sqlite(kept / "sqlite", sizes)
                for f in (kept / "sqlite").glob("catalog.db*"):  # its -wal too, if one is left
                    shutil.copyfile(f, d / f.name)
            results["sqlite"] = bench_catalog(f"sqlite:///{db}", *args, seeded=seeded, only_queries=a.only_queries)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        print(json.dumps(results["sqlite"], indent=1), flush=True)
    if a.backend in ("postgresql", "both"):
        from tests.pg import PG_BIN, _as_postgres, _start  # the tests' throwaway server (fsync off)

        root, seeded = pg_root(), None
        if kept is not None:
            seeded = pristine_postgresql(kept / "postgresql", sizes)
            subprocess.run(["cp", "-a", str(kept / "postgresql" / "data"), str(root / "data")], check=True)
        server = _start(root, initdb=seeded is None)
        try:
            url = server.url(seeded["database"] if seeded else server.create_database("bench"))
            results["postgresql"] = bench_catalog(url, *args, seeded=seeded, only_queries=a.only_queries)
        finally:
            _as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(server.data_dir), "-m", "fast", "-w", "stop")
            shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(results["postgresql"], indent=1), flush=True)
    results["load_at_end"] = os.getloadavg()[0]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "catalog.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {a.out / 'catalog.json'}")


if __name__ == "__main__":
    main()
