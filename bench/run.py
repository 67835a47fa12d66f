"""lastgood's benchmark: one command, one run, the same state and the same disk.

    python -m bench.run                 # the full benchmark (make bench): 256 MiB, 1 GiB, 4 GiB
    python -m bench.run --smoke         # tiny sizes, every figure, well under a minute (tests/bench)

Prints a table and writes the same figures as JSON under bench/results/ (latest.json and
a timestamped copy; --out picks another folder). Every figure is the median of --reps
repetitions (at least 3); repetitions of the cases that are compared are interleaved
(rep 1 of every case, then rep 2, ...; each rep in another order, every case behind
another neighbour: bench.common.order_of) so that load from other processes, and what
the case before leaves, fall on them alike; every ratio is taken between figures of this
one run. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

from bench.common import (GiB, MiB, ROOT, RssSampler, Service, drop_clean_cache, free_page_reporting, machine, median,
                          parse_size, rm, settle, size_label, spread)
from bench.one_size import DROPPED, FRESH_CACHE, SERVICE_ENV, SETTLED, Pipe, log, size_block
from bench.peers import raw_write
from bench.report import PER_SIZE, QUIET, RATIOS, TARGETS, evaluate, table  # noqa: F401 - PER_SIZE, RATIOS, TARGETS: tests/bench

# --quiet-wait: seconds between two quiet checks while waiting for a quiet window
QUIET_PAUSE = 30.0


# ---------------------------------------------------------------------------- four ranks
class RankProcs:
    """N rank processes (python -m bench.ranks), each with its own state and Checkpointer,
    saving one checkpoint of world size N together. `start()` launches them (they import
    torch and build their state); `run()` measures."""

    def __init__(self, per_rank: int, ranks: int, work: Path, spool: bool = True) -> None:
        self.per_rank, self.ranks, self.work, self.spool = per_rank, ranks, work, spool
        self.svc = Service(work / "svc-ranks", SERVICE_ENV)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> "RankProcs":
        self.svc.start()
        run, attempt = f"bench-ranks-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex[:12]
        for r in range(self.ranks):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(self.ranks), "LOCAL_WORLD_SIZE": str(self.ranks),
                   "LASTGOOD_LOG_LEVEL": "WARNING",
                   "LASTGOOD_USE_SPOOL": "1" if self.spool else "0"}
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.ranks", self.svc.url, run, attempt, str(self.per_rank)],
                cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write("quit\n")
                    p.stdin.flush()
                    p.wait(60)
                except (OSError, subprocess.TimeoutExpired):
                    p.kill()
                    p.wait()
        self.svc.stop()
        shutil.rmtree(self.work / "svc-ranks", ignore_errors=True)

    def run(self, reps: int) -> dict:
        procs, svc, ranks = self.procs, self.svc, self.ranks
        total = 0
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("a rank process exited before it was ready")
            total += json.loads(line)["bytes"]
        log(f"\n== {ranks} ranks x {size_label(self.per_rank)} (separate processes, one checkpoint of world size "
            f"{ranks}, {'spool' if self.spool else 'streamed'}): {total / MiB:.0f} MiB in all; {reps} reps + 1 warm-up")

        def save(step: int) -> float:
            for p in procs:
                p.stdin.write(f"save {step}\n")
                p.stdin.flush()
            outs = [json.loads(p.stdout.readline()) for p in procs]
            return max(o["t1"] for o in outs) - min(o["t0"] for o in outs)

        warm = save(0)
        svc.gc()
        raw, agg = [], []
        (self.work / "files").mkdir(exist_ok=True)
        raw_path = self.work / "files" / "raw-ranks.bin"
        rss_peaks = []
        for i in range(reps):
            raw.append(raw_write(raw_path, total))
            with RssSampler(svc.pid) as rss:
                agg.append(save(i + 1))
            rss_peaks.append(rss.peak / MiB)
            svc.gc()
            log(f"  rep {i + 1}: raw write+fsync {raw[-1]:.2f} s, {ranks} ranks to commit {agg[-1]:.2f} s "
                f"({total / GiB / agg[-1]:.2f} GiB/s vs {total / GiB / raw[-1]:.2f} GiB/s); service RSS peak "
                f"{rss_peaks[-1]:.0f} MiB")
        gib = total / GiB
        return {"ranks": ranks, "spool": self.spool, "per_rank_bytes": self.per_rank, "bytes": total, "reps": reps,
                "warmup_s": warm,
                "aggregate_s": agg, "raw_s": raw, "aggregate_gib_per_s": gib / median(agg),
                "raw_gib_per_s": gib / median(raw), "ratio": median(raw) / median(agg),
                "service_rss_peak_mib_reps": rss_peaks, "service_rss_peak_mib": median(rss_peaks)}


# ---------------------------------------------------------------------------- main
def run_sizes(sizes, reps_for, work: Path) -> list[dict]:
    """The per-size comparisons, one size after another over one pipe."""
    pipe = Pipe(work)
    try:
        return [size_block(target, reps_for(target), work, pipe) for target in sizes]
    finally:
        pipe.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and counts: checks that every case runs")
    ap.add_argument("--sizes", help="comma list of state sizes (default 256M,1G,4G; smoke 4M)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per figure (default 5 at every size; smoke 3)")
    ap.add_argument("--rank-size", help="state size of each of the 4 ranks (default 1G; smoke 4M)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--scale-ranks", type=int, default=None, help="ranks of the scale checkpoint (default 1024)")
    ap.add_argument("--catalog", type=int, default=None, help="committed checkpoints in the catalog (default 10000)")
    ap.add_argument("--no-waiting-votes", action="store_true",
                    help="skip the 1,024 ranks voting with wait_seconds=2 (about 35 s a rep)")
    ap.add_argument("--workdir", help="scratch folder on the disk under test (default: a new one under /tmp)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="where the JSON goes")
    ap.add_argument("--quiet-check", action="store_true",
                    help="first measure the disk's own variance (raw write + fsync, settled between) and say "
                         "whether the machine is quiet enough for acceptance figures")
    ap.add_argument("--quiet-wait", type=float, default=0.0, metavar="SECONDS",
                    help="with --quiet-check: while the disk is NOT QUIET, measure again every "
                         f"{QUIET_PAUSE:.0f} s for up to this long before the run starts (every attempt is recorded)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="do not drop the clean page cache before each save case (bench/common.drop_clean_cache)")
    ap.add_argument("--only-sizes", action="store_true",
                    help="only the per-size save/restore comparisons (no 4-rank, scale or catalog parts)")
    args = ap.parse_args(argv)
    # DCP without a process group says it assumes one process, on every call: it does
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    smoke = args.smoke
    FRESH_CACHE[0] = not (args.keep_cache or smoke)  # the smoke run (tests/bench) leaves the machine's cache alone
    sizes = [parse_size(s) for s in (args.sizes or ("4M" if smoke else "256M,1G,4G")).split(",")]
    reps_for = (lambda n: args.reps) if args.reps else (lambda n: 3 if smoke else 5)
    if args.reps is not None and args.reps < 3:
        ap.error("--reps must be at least 3: every figure is a median of three or more")
    rank_size = parse_size(args.rank_size or ("4M" if smoke else "1G"))
    scale_ranks = args.scale_ranks or (32 if smoke else 1024)
    catalog_n = args.catalog or (300 if smoke else 10000)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lastgood-bench-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    need = 3 * max(sizes) + 2 * rank_size * args.ranks
    free = shutil.disk_usage(work).free
    if free < need:
        log(f"not enough free disk in {work}: {free / GiB:.1f} GiB free, about {need / GiB:.1f} GiB needed")
        return 2
    command = "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict = {"command": command.strip(), "smoke": smoke, "machine": machine(),
                     "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "workdir": str(work), "sizes": []}
    log(f"lastgood benchmark: sizes {', '.join(size_label(s) for s in sizes)}; workdir {work} "
        f"({free / GiB:.0f} GiB free); load average {os.getloadavg()[0]:.2f}")
    if FRESH_CACHE[0]:
        log("each save case starts with the clean page cache dropped (root; --keep-cache: not)"
            + ("; this machine hands freed memory back to its host (free page reporting)" if free_page_reporting() else ""))
    t_start = time.perf_counter()
    if args.quiet_check:
        results["quiet_check"] = wait_for_quiet(work, min(max(sizes), GiB), 3 if smoke else 7, args.quiet_wait)
    if args.only_sizes:
        results["sizes"] = run_sizes(sizes, reps_for, work)
        return finish(results, args, work, t_start, smoke)
    rank_procs = RankProcs(rank_size, args.ranks, work)
    try:
        if smoke:  # the rank processes import torch while the sizes run (full runs keep them apart)
            rank_procs.start()
        results["sizes"] = run_sizes(sizes, reps_for, work)
        if not smoke:
            rank_procs.start()
        results["four_ranks"] = rank_procs.run(3)
        rank_procs.stop()
        rank_procs = RankProcs(rank_size, args.ranks, work, spool=False).start()
        results["four_ranks_stream"] = rank_procs.run(3)
    finally:
        rank_procs.stop()

    from bench import scale

    log(f"\n== scale: {scale_ranks} ranks with tiny shards (a load generator plays the ranks)")
    results["scale"] = scale.commit_at_scale(work, scale_ranks, 3, 0 if args.no_waiting_votes else 3, log)
    log(f"\n== catalog: GET a run's checkpoint list with {catalog_n:,} committed checkpoints")
    results["catalog"] = scale.list_latency(work, catalog_n, 3, 20 if smoke else 200, log)

    return finish(results, args, work, t_start, smoke)


def wait_for_quiet(work: Path, nbytes: int, reps: int, wait_s: float) -> dict:
    """quiet_check(), again every QUIET_PAUSE seconds while it says NOT QUIET and `wait_s` is not
    spent: the bound stays what it is, the run only starts in a quiet window when one comes.
    The last attempt is the verdict; every attempt is kept under "attempts"."""
    deadline = time.monotonic() + wait_s
    attempts = [quiet_check(work, nbytes, reps)]
    while not attempts[-1]["quiet"] and time.monotonic() + QUIET_PAUSE < deadline:
        log(f"quiet check: waiting {QUIET_PAUSE:.0f} s for a quiet window "
            f"({deadline - time.monotonic():.0f} s of --quiet-wait left)")
        time.sleep(QUIET_PAUSE)
        attempts.append(quiet_check(work, nbytes, reps))
    return {**attempts[-1], "attempts": attempts}


def quiet_check(work: Path, nbytes: int, reps: int) -> dict:
    """The disk's own variance: `reps` raw writes + fsync of `nbytes`, the writeback settled
    before each. On a quiet machine they agree within QUIET; when they do not, no ratio of
    this run can be trusted to a few percent, whatever the code does."""
    path = work / "quiet.bin"
    load0 = os.getloadavg()[0]
    times = []
    for _ in range(reps + 1):
        settle()
        if FRESH_CACHE[0]:  # as before every save case
            drop_clean_cache()
        times.append(raw_write(path, nbytes))
    rm(path)
    # the first write of a machine that sat idle meets memory freed long ago, which this VM
    # has handed back to its host (docs/performance.md): a warm-up, as every case has one
    warmup, times = times[0], times[1:]
    load1 = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    out = {"bytes": nbytes, "seconds": times, "warmup_s": warmup, "median_s": median(times), "spread": spread(times),
           "loadavg": [load0, load1], "cpus": cpus}
    out["quiet"] = out["spread"] <= QUIET and max(load0, load1) < 0.5 * cpus
    log(f"quiet check: raw write + fsync of {nbytes / MiB:.0f} MiB × {reps} after one warm-up ({warmup:.2f} s): "
        f"median {median(times):.2f} s, spread "
        f"{out['spread'] * 100:.0f}% (quiet ≤ {QUIET * 100:.0f}%), load {load0:.1f} → {load1:.1f} on {cpus} CPUs: "
        + ("QUIET" if out["quiet"] else "NOT QUIET: these figures cannot settle the targets; run again on an idle machine"))
    return out


def finish(results: dict, args, work: Path, t_start: float, smoke: bool) -> int:
    rss_label = next((b["label"] for b in results["sizes"] if b["target_bytes"] == 4 * GiB),
                     results["sizes"][-1]["label"])
    results["service_rss"] = {"size": rss_label,
                              **next(b["service_rss"] for b in results["sizes"] if b["label"] == rss_label)}
    results["targets"] = evaluate(results, rss_label)
    results["elapsed_s"] = time.perf_counter() - t_start
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["settle_s"] = {"cases": len(SETTLED), "total": sum(SETTLED), "max": max(SETTLED, default=0.0)}
    results["page_cache"] = {"drop_before_saves": FRESH_CACHE[0], "dropped": sum(DROPPED), "of": len(DROPPED),
                             "free_page_reporting": free_page_reporting()}
    shutil.rmtree(work, ignore_errors=True)

    text = table(results)
    results["table_markdown"] = text
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    kind = "smoke" if smoke else "sizes" if args.only_sizes else "bench"
    name = f"{kind}-{stamp}.json"
    body = json.dumps(results, indent=1, default=str)
    for target in (out / name, out / ("latest.json" if kind == "bench" else f"{kind}-latest.json")):
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(body)
        os.replace(tmp, target)
    log(f"\n{text}\n\nelapsed {results['elapsed_s'] / 60:.1f} min; load average at the end "
        f"{os.getloadavg()[0]:.2f}; results in {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
