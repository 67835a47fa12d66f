"""GC's dry run at thousands of runs (issue 36): what `GET /api/v1/gc/plan` costs.

    python -m bench.gc_plan                        # 3,000 runs x 10 checkpoints x 2 ranks, SQLite
    python -m bench.gc_plan --runs 300 --out /tmp/x

The catalog is seeded (bench/seed.py, GC having kept up), then planned as the route plans:
`full` (every run, one short read transaction each, and the store listed; what the route
did before), and incremental (the runs where something changed since the last executed
pass; what the route does). Incremental is timed before any pass (every run unmarked, so
every run is planned), after two passes (nothing changed), and after `--changed` runs
each recorded one event. The blob store is in memory: what is measured is the catalog.
Writes bench/results/gc_plan.json (`--out DIR` elsewhere).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from lastgood_service.blobstore import MemoryBlobStore
from lastgood_service.catalog.db import make_engine, make_sessionmaker, read_sessionmaker
from lastgood_service.catalog.models import Run
from lastgood_service.domain.events import add_event
from lastgood_service.domain.gc import GarbageCollector
from lastgood_service.domain.runs.retention import Retention

from .common import ROOT
from .seed import seed

POLICY = "latest:3,tagged,last-good,branch-heads"


def timed(gc: GarbageCollector, full: bool, reps: int) -> dict:
    times, planned = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        plan = gc.plan(full=full)
        times.append(time.perf_counter() - t0)
        planned = len(plan.runs)
    return {"seconds_median": round(sorted(times)[len(times) // 2], 3), "seconds_max": round(max(times), 3),
            "runs_planned": planned, "reps": reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--changed", type=int, default=30, help="runs that record an event before the last plan")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="lg-bench-gcplan-"))
    url = f"sqlite:///{d / 'catalog.db'}"
    out = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
           "load_at_start": os.getloadavg()[0], "runs": a.runs, "checkpoints_per_run": a.checkpoints,
           "ranks": a.ranks, "catalog": "sqlite"}
    try:
        out["seed"] = seed(url, runs=a.runs, checkpoints=a.checkpoints, ranks=a.ranks)
        engine = make_engine(url)
        sessions = make_sessionmaker(engine)
        gc = GarbageCollector(sessions, MemoryBlobStore(), Retention.parse(POLICY), 3600,
                              read_sessions=read_sessionmaker(engine))
        out["full (every run, the store listed)"] = timed(gc, True, a.reps)
        out["incremental, no pass yet (every run unmarked)"] = timed(gc, False, 1)
        for _ in range(2):  # the second settles the runs whose deletions the first recorded
            gc.execute(gc.plan(full=True))
        out["incremental, nothing changed"] = timed(gc, False, a.reps)
        with sessions() as s, s.begin():
            for run_id in list(s.scalars(Run.__table__.select().with_only_columns(Run.id).limit(a.changed))):
                add_event(s, "note", run_id, None, text="bench")
        out[f"incremental, {a.changed} runs changed"] = timed(gc, False, a.reps)
        engine.dispose()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out["load_at_end"] = os.getloadavg()[0]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gc_plan.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
