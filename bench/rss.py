"""The service's RSS at equal work (issue 20): a soak's RSS depends on how many saves the
machine's load let through, so this runs a fixed amount of work instead.

    python -m bench.rss                       # 60 rounds on 3 runs of 7,000 checkpoints
    LASTGOOD_MALLOC_TRIM=false python -m bench.rss --out /tmp/x

A catalog seeded as a soak leaves it after ~30 minutes (bench/seed.py: 3 runs of 7,000
checkpoints of 2 ranks, all but the newest 3 DELETED), a real service process on it (GC
every 3 s, `latest:3`), then `--rounds` rounds of: one save into each run over gRPC, and
what the web page polls (the overview, a run's lineage page by page, its events). RSS is
read after start, half-way and at the end (after a last GC pass). Results:
bench/results/rss.json; run against an older commit by putting its tree first on
PYTHONPATH (the service process inherits it).
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

from lastgood_service.launcher import ServiceProcess

from .common import ROOT
from .seed import seed
from .soak import get, lineage_pages, proc_stats


def measure(rounds: int, data_dir: Path) -> dict:
    from tests.service.helpers import Client  # the gRPC calls a trainer's ranks make

    seed(f"sqlite:///{data_dir / 'catalog.db'}", runs=3, checkpoints=7000, ranks=2, prefix="soak")
    svc = ServiceProcess(data_dir, {"LASTGOOD_RETENTION": "latest:3,tagged,last-good,branch-heads",
                                    "LASTGOOD_GC_INTERVAL": "3", "LASTGOOD_GC_GRACE_SECONDS": "60"})
    svc.start()
    out: dict = {}
    try:
        c = Client(svc.grpc_target)
        time.sleep(4)  # the first (full) GC pass
        out["rss_start_mib"] = proc_stats(svc.pid)["rss_mib"]
        parents: dict[str, int] = {}
        for i in range(rounds):
            step = 10_000_000 + i
            for r in range(3):
                run = f"soak-{r + 1:05d}"
                # the test shard's values take seed + step as a uint8: keep that below 200
                parents[run], _ = c.save(run, step, world_size=2, parent_id=parents.get(run, 0),
                                         seed=step % 200 - step)
            run = f"soak-{i % 3 + 1:05d}"
            get(svc.url + "/api/v1/overview?limit=1000")
            lineage_pages(f"{svc.url}/api/v1/runs/{run}/lineage")
            get(f"{svc.url}/api/v1/runs/{run}/events?kind=spike,rollback,restart,launch&limit=1000")
            if i == rounds // 2:
                out["rss_half_mib"] = proc_stats(svc.pid)["rss_mib"]
        time.sleep(7)  # a last GC pass or two
        out.update({"rss_end_mib": proc_stats(svc.pid)["rss_mib"]})
        c.close()
    finally:
        svc.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="lg-rss-"))
    try:
        res = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "rounds": a.rounds,
               "malloc_trim": os.environ.get("LASTGOOD_MALLOC_TRIM", "true"), "load_at_start": os.getloadavg()[0],
               **measure(a.rounds, d), "load_at_end": os.getloadavg()[0]}
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(json.dumps(res), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "rss.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
