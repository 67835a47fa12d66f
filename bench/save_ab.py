"""Same-host save variants against DCP, in one process, alternating rep by rep.

    python -m bench.save_ab --size 1G --reps 12                       # followed, written whole, DCP
    python -m bench.save_ab --size 4G --reps 6 --variants dcp,followed,followed-4-files,whole-4-files

What `make bench-save` cannot tell apart because it runs them in separate cases: how much
the followed hand-over, early writeback and splitting into files each give. One state, one
service, one Checkpointer; before each case the dirty backlog is written out and the clean
page cache dropped, as in bench/run.py. Variants:

  dcp                DCP save (thread_count=2, sync_files=True)
  followed           one file a rank, the service hashes it as it is written
  whole              one file a rank, handed over once written (the service re-reads it)
  no-writeback       followed, without starting writeback early (lastgood.common.durable.Writeback off)
  <any>-N-files      the same split into N files (LASTGOOD_FILE_BYTES chosen to give N; the
                     default save splits a state of 512 MiB or more, a file per core)

Prints medians, quartiles and rep-by-rep ratios to DCP; writes bench/results/save_ab-<size>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import (GiB, ROOT, Service, build_state, drop_clean_cache, iqr_spread, machine, order_of, parse_size,
                          settle, size_label, state_bytes, write_results)
from bench.one_size import SERVICE_ENV
from bench.peers import dcp_save
from lastgood.common import durable


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.save_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--variants", default="dcp,followed,whole,no-writeback")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--keep-cache", action="store_true", help="do not drop the clean page cache before each case")
    args = ap.parse_args(argv)
    import lastgood

    target = parse_size(args.size)
    variants = args.variants.split(",")
    work = Path(tempfile.mkdtemp(prefix="lastgood-save-ab-", dir="/tmp"))
    model, opt = build_state(target)
    nbytes = state_bytes(model, opt)
    svc = Service(work / "svc", SERVICE_ENV).start()
    state = lastgood.TrainState(model=model, optimizer=opt)
    ckpt = lastgood.Checkpointer(svc.url, run=f"save-ab-{uuid.uuid4().hex[:6]}")
    follows = bool(ckpt.transport.spool and ckpt.transport.spool.get("follow"))
    real_start = durable.Writeback.start
    step = [0]

    def lastgood_case(name: str):
        base, _, files = name.partition("-files")[0].rpartition("-") if name.endswith("-files") else (name, "", "")
        n = int(files) if files else 1

        def run() -> float:
            ckpt.transport.spool["follow"] = follows and base in ("followed", "no-writeback")
            ckpt.config = dataclasses.replace(ckpt.config, file_bytes=0 if n == 1 else nbytes // n, files_by_cores=False)
            durable.Writeback.start = (lambda self, offset, length: None) if base == "no-writeback" else real_start
            step[0] += 1
            t0 = time.perf_counter()
            ckpt.save(step[0], state)
            ckpt.wait()
            return time.perf_counter() - t0
        return run

    cases = {v: (lambda: dcp_save(model, opt, work / "dcp")) if v == "dcp" else lastgood_case(v) for v in variants}
    try:
        cases[next(v for v in variants if v != "dcp")]()  # warm-up: the staging buffer
        svc.gc()
        times: dict[str, list[float]] = {v: [] for v in variants}
        for i in range(args.reps):
            order = order_of(variants, i)
            for v in order:
                settle()
                if not args.keep_cache:
                    drop_clean_cache()
                times[v].append(cases[v]())
                svc.gc()
            print(f"rep {i + 1}: " + ", ".join(f"{v} {times[v][-1]:.2f} s" for v in variants), flush=True)
    finally:
        durable.Writeback.start = real_start
        ckpt.close()
        svc.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = {"command": "python -m bench.save_ab " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine(), "bytes": nbytes, "reps": args.reps, "follow_offered": follows, "variants": {}}
    for v in variants:
        xs = times[v]
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        entry = {"seconds": xs, "median_s": statistics.median(xs), "q1_s": q1, "q3_s": q3,
                 "iqr_spread": iqr_spread(xs), "gib_per_s": nbytes / GiB / statistics.median(xs)}
        if "dcp" in times and v != "dcp":
            entry["vs_dcp_reps"] = [d / x for d, x in zip(times["dcp"], xs)]
            entry["vs_dcp"] = statistics.median(times["dcp"]) / statistics.median(xs)
        out["variants"][v] = entry
        print(f"{v:>24}: median {entry['median_s']:.3f} s (q1 {q1:.3f}, q3 {q3:.3f})"
              + (f", DCP / it {entry['vs_dcp']:.2f}x (rep by rep {min(entry['vs_dcp_reps']):.2f}-"
                 f"{max(entry['vs_dcp_reps']):.2f})" if "vs_dcp" in entry else ""))
    write_results(args.out, f"save_ab-{size_label(target).replace(' ', '')}", out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("LASTGOOD_LOG_LEVEL", "WARNING")
    sys.exit(main())
