"""A soak of the embedded service (issue 20): writers, scheduled GC and a page that polls,
for a long time, reported per window so that drift shows.

    make soak                                  # 30 minutes, 6 windows of 5 minutes
    python -m bench.soak --minutes 6 --windows 3 --out /tmp/soak   # a shorter one

A real service process (SQLite, local blob store, GC every `--gc-interval` s with
`latest:3`); `--writers` threads each save small checkpoints of `--ranks` ranks one after
another into their own run over gRPC (begin, upload, vote: what a trainer's ranks send);
one thread polls what the web page polls (overview, the lineage and events of a run).
Per window: saves, errors, save -> commit p50/p99, the page's p99, the service's RSS,
open files and threads, and GC's longest catalog transaction (lastgood_gc_transaction_seconds).
Not part of CI; results in bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from lastgood_service.launcher import ServiceProcess

from .catalog import pct
from .common import ROOT


def proc_stats(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) // 1024
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    return {"rss_mib": rss, "threads": threads, "open_files": len(os.listdir(f"/proc/{pid}/fd"))}


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


def lineage_pages(url: str, drawn: int = 10000) -> int:
    """What the web page reads of a run's lineage (static/app.js, loadLineage): page after
    page of the service's default size, up to the `drawn` oldest checkpoints; returns how many."""
    n, total = 0, 1
    while n < min(total, drawn):
        page = json.loads(get(f"{url}?offset={n}"))
        if not page["nodes"]:
            break
        n, total = n + len(page["nodes"]), page["total"]
    return n


def gc_histogram(url: str) -> tuple[float, int, float | None]:
    """(sum, count, smallest bucket bound holding every observation) of GC's transactions."""
    text = get(url + "/metrics").decode()
    total = float(re.search(r"^lastgood_gc_transaction_seconds_sum (\S+)", text, re.M).group(1))
    count = int(float(re.search(r"^lastgood_gc_transaction_seconds_count (\S+)", text, re.M).group(1)))
    bound = None
    for le, n in re.findall(r'^lastgood_gc_transaction_seconds_bucket\{le="([^"]+)"\} (\S+)', text, re.M):
        if float(n) >= count and count:
            bound = float(le)
            break
    return total, count, bound


def soak(minutes: float, windows: int, writers: int, ranks: int, gc_interval: float, data_dir: Path) -> dict:
    from tests.service.helpers import Client  # the gRPC calls a trainer's ranks make

    svc = ServiceProcess(data_dir, {"LASTGOOD_RETENTION": "latest:3,tagged,last-good,branch-heads",
                                    "LASTGOOD_GC_INTERVAL": str(gc_interval), "LASTGOOD_GC_GRACE_SECONDS": "60"})
    svc.start()
    stop = threading.Event()
    lock = threading.Lock()
    saves: list[tuple[float, float]] = []   # (when, seconds)
    errors: list[tuple[float, str]] = []
    polls: list[tuple[float, float]] = []

    def writer(i: int) -> None:
        c = Client(svc.grpc_target)
        parent, step = 0, 0
        try:
            while not stop.is_set():
                step += 1
                t0 = time.perf_counter()
                try:
                    # the test shard's values take seed + step as a uint8: keep that below 200
                    parent, _ = c.save(f"soak-{i}", step, world_size=ranks, parent_id=parent,
                                       seed=step % 200 - step)
                    with lock:
                        saves.append((time.monotonic(), time.perf_counter() - t0))
                except Exception as e:  # noqa: BLE001 - counted, the soak goes on
                    with lock:
                        errors.append((time.monotonic(), repr(e)[:200]))
        finally:
            c.close()

    def page() -> None:
        stop.wait(5.0)  # the runs exist by then
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                get(svc.url + "/api/v1/overview")
                lineage_pages(svc.url + "/api/v1/runs/soak-0/lineage")
                get(svc.url + "/api/v1/runs/soak-0/events?kind=spike,rollback,restart,launch&limit=1000")
                polls.append((time.monotonic(), time.perf_counter() - t0))
            except Exception as e:  # noqa: BLE001
                errors.append((time.monotonic(), "page: " + repr(e)[:200]))
            stop.wait(2.0)

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(writers)]
    threads.append(threading.Thread(target=page, daemon=True))
    start = time.monotonic()
    for t in threads:
        t.start()
    out = []
    try:
        window = minutes * 60 / windows
        for w in range(windows):
            gc0 = gc_histogram(svc.url)
            time.sleep(max(0.0, start + (w + 1) * window - time.monotonic()))
            lo, hi = start + w * window, start + (w + 1) * window
            with lock:
                lat = [s for at, s in saves if lo <= at < hi]
                errs = [e for at, e in errors if lo <= at < hi]
            page_lat = [s for at, s in polls if lo <= at < hi]
            gc1 = gc_histogram(svc.url)
            out.append({"window": w + 1, "minutes": round((hi - start) / 60, 1), "saves": len(lat),
                        "errors": len(errs), "first_error": errs[0] if errs else None,
                        "save_p50_ms": round(pct(lat, 50) * 1000, 1), "save_p99_ms": round(pct(lat, 99) * 1000, 1),
                        "page_p99_ms": round(pct(page_lat, 99) * 1000, 1),
                        "gc_transactions": gc1[1] - gc0[1],
                        "gc_transaction_mean_ms": round((gc1[0] - gc0[0]) / max(1, gc1[1] - gc0[1]) * 1000, 2),
                        "gc_longest_transaction_so_far_le_s": gc1[2], **proc_stats(svc.pid)})
            print(json.dumps(out[-1]), flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        svc.stop()
    return {"windows": out, "total_saves": len(saves), "total_errors": len(errors)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--gc-interval", type=float, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="lg-soak-"))
    try:
        res = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "minutes": a.minutes,
               "writers": a.writers, "ranks": a.ranks, "gc_interval": a.gc_interval, "cpus": os.cpu_count(),
               "load_at_start": os.getloadavg()[0],
               "malloc_trim": os.environ.get("LASTGOOD_MALLOC_TRIM", "true"),  # the service inherits it
               **soak(a.minutes, a.windows, a.writers, a.ranks, a.gc_interval, d), "load_at_end": os.getloadavg()[0]}
    finally:
        shutil.rmtree(d, ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "soak.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out / 'soak.json'}")


if __name__ == "__main__":
    main()
