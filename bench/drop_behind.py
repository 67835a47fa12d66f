"""The service's drop-behind (LASTGOOD_SPOOL_CACHE_BYTES) against DCP, in one process,
alternating rep by rep: what it gives a large save, and what a restore right after pays.

    python -m bench.drop_behind --size 4G --reps 4 --limits=-1,512M,0

One state, one Checkpointer per limit, each against a service of its own started with
that LASTGOOD_SPOOL_CACHE_BYTES (-1: never drop, the behaviour before 2026-12-02; 512M:
the default; 0: drop everything behind), all sharing one staging buffer. Before each case the
dirty backlog is written out and the clean page cache dropped, as in bench/run.py. After
each lastgood save the same Checkpointer restores it (hash-verified, in place): the restore
a same-host restart would pay, reading what the save left in the page cache. Writes
bench/results/drop_behind-<size>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import (ROOT, Service, build_state, drop_clean_cache, iqr_spread, machine, order_of, parse_size,
                          settle, size_label, state_bytes, write_results)
from bench.one_size import SERVICE_ENV
from bench.peers import dcp_save


def _limit(text: str) -> str:
    return "-1" if text == "-1" else str(parse_size(text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.drop_behind", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="4G")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--limits", default="-1,512M,0", help="LASTGOOD_SPOOL_CACHE_BYTES values, comma-separated")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--keep-cache", action="store_true", help="do not drop the clean page cache before each case")
    args = ap.parse_args(argv)
    import lastgood

    limits = args.limits.split(",")
    work = Path(tempfile.mkdtemp(prefix="lastgood-drop-behind-", dir="/tmp"))
    model, opt = build_state(parse_size(args.size))
    nbytes = state_bytes(model, opt)
    state = lastgood.TrainState(model=model, optimizer=opt)
    svcs, ckpts = {}, {}
    try:
        for lim in limits:
            svcs[lim] = Service(work / f"svc{len(svcs)}", {**SERVICE_ENV, "LASTGOOD_SPOOL_CACHE_BYTES": _limit(lim)})
            svcs[lim].start()
            ckpts[lim] = lastgood.Checkpointer(svcs[lim].url, run=f"drop-behind-{uuid.uuid4().hex[:6]}")
            if len(ckpts) > 1:  # one job, one staging buffer (bench/run.py)
                ckpts[lim]._pool = ckpts[limits[0]]._pool
        step = [0]

        def save(lim: str) -> float:
            step[0] += 1
            t0 = time.perf_counter()
            ckpts[lim].save(step[0], state)
            ckpts[lim].wait()
            t = time.perf_counter() - t0
            svcs[lim].gc()
            return t

        for lim in limits:  # warm-up: the staging buffer, each service's first commit
            save(lim)
        cases = ["dcp"] + limits
        times: dict[str, list[float]] = {c: [] for c in cases}
        restores: dict[str, list[float]] = {lim: [] for lim in limits}
        for i in range(args.reps):
            for case in order_of(cases, i):
                settle()
                if not args.keep_cache:
                    drop_clean_cache()
                if case == "dcp":
                    times[case].append(dcp_save(model, opt, work / "dcp"))
                    continue
                times[case].append(save(case))
                settle()
                t0 = time.perf_counter()
                assert ckpts[case].restore(state) == step[0]
                restores[case].append(time.perf_counter() - t0)
            print(f"rep {i + 1}: " + ", ".join(f"{c} {times[c][-1]:.2f} s" for c in cases) + " | restore after: "
                  + ", ".join(f"{lim} {restores[lim][-1]:.2f} s" for lim in limits), flush=True)
    finally:
        for c in ckpts.values():
            c.close()
        for s in svcs.values():
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = {"command": "python -m bench.drop_behind " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine(), "bytes": nbytes, "reps": args.reps, "cases": {}}
    for case in cases:
        xs = times[case]
        entry = {"seconds": xs, "median_s": statistics.median(xs), "iqr_spread": iqr_spread(xs)}
        if case != "dcp":
            entry["vs_dcp_reps"] = [d / x for d, x in zip(times["dcp"], xs)]
            entry["vs_dcp"] = statistics.median(times["dcp"]) / statistics.median(xs)
            entry["restore_after_s"] = restores[case]
            entry["restore_after_median_s"] = statistics.median(restores[case])
        out["cases"]["dcp" if case == "dcp" else f"spool_cache_bytes={case}"] = entry
        print(f"{case:>6}: save median {entry['median_s']:.2f} s"
              + (f", DCP / it {entry['vs_dcp']:.2f}x (rep by rep {min(entry['vs_dcp_reps']):.2f}-"
                 f"{max(entry['vs_dcp_reps']):.2f}), restore right after {entry['restore_after_median_s']:.2f} s"
                 if case != "dcp" else ""))
    write_results(args.out, f"drop_behind-{size_label(parse_size(args.size)).replace(' ', '')}", out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("LASTGOOD_LOG_LEVEL", "WARNING")
    sys.exit(main())
