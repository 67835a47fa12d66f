"""A restore that finds nothing in the page cache (a restarted node, a large file the
service dropped behind its hash): lastgood reading past the page cache (O_DIRECT where it
holds nothing: lastgood.common.durable.read_into) against the same restore through the page cache,
and against DCP's load, alternating rep by rep, the whole clean page cache dropped before each.

    python -m bench.cold_restore --size 4G --reps 5

One state saved once by each (lastgood to a service of its own on the same host: the
spool; DCP with 2 threads), then each rep restores in place with every cached page of
the machine dropped first (root). "through the page cache" is the same Checkpointer with
durable.COLD_BELOW below zero, so every piece counts as cached and is read plainly: the
restore before 2026-12-02. Writes bench/results/cold_restore-<size>.json.
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
from bench.peers import dcp_load, dcp_save

CASES = ("past the page cache", "through the page cache", "dcp load")
IN_MEMORY = ("tmpfs", "ramfs")  # file systems whose pages are the files: nothing on them is ever cold


def fs_type(path: Path) -> str:
    """The type of the file system `path` is on (the longest mount point above it)."""
    with open("/proc/mounts") as f:
        mounts = [line.split()[1:3] for line in f]
    p = str(path.resolve())
    return max((m for m in mounts if p == m[0] or p.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=("", "?"))[1]


def count_direct(durable) -> list:
    """Count the bytes read with O_DIRECT from here on (wraps durable._Direct.read): [bytes]."""
    box, real = [0], durable._Direct.read

    def read(self, target, offset):
        got = real(self, target, offset)
        box[0] += got or 0
        return got
    durable._Direct.read = read
    return box


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cold_restore", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="4G")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/tmp", help="where the service's data and DCP's files go (a disk, not tmpfs)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--keep-cache", action="store_true",
                    help="do not drop the page cache (nothing is cold then: the smoke test's way to run every case)")
    args = ap.parse_args(argv)
    import lastgood
    from lastgood.common import durable

    work = Path(tempfile.mkdtemp(prefix="lastgood-cold-restore-", dir=args.dir))
    fs = fs_type(work)
    if fs in IN_MEMORY and not args.keep_cache:
        shutil.rmtree(work, ignore_errors=True)
        print(f"{args.dir} is on {fs}: its pages are the files, nothing there is ever cold; give --dir on a disk")
        return 2
    direct = count_direct(durable)
    model, opt = build_state(parse_size(args.size))
    nbytes = state_bytes(model, opt)
    state = lastgood.TrainState(model=model, optimizer=opt)
    svc = Service(work / "svc", dict(SERVICE_ENV))
    svc.start()
    ckpt = lastgood.Checkpointer(svc.url, run=f"cold-restore-{uuid.uuid4().hex[:6]}")
    cold_below = durable.COLD_BELOW
    times: dict[str, list[float]] = {c: [] for c in CASES}
    direct_bytes: dict[str, list[int]] = {c: [] for c in CASES[:2]}  # read with O_DIRECT, per rep
    try:
        ckpt.save(1, state)
        ckpt.wait()
        dcp_save(model, opt, work / "dcp")
        ckpt.restore(state)  # warm-up: the staging buffer is touched once, as in a job that saved before
        for i in range(args.reps):
            for case in order_of(list(CASES), i):
                settle()
                if not args.keep_cache and not drop_clean_cache():
                    print("cannot drop the page cache (needs root): no restore here would be cold")
                    return 2
                if case == "dcp load":
                    times[case].append(dcp_load(model, opt, work / "dcp"))
                    continue
                durable.COLD_BELOW = cold_below if case == "past the page cache" else -1.0
                before, t0 = direct[0], time.perf_counter()
                assert ckpt.restore(state) == 1
                times[case].append(time.perf_counter() - t0)
                direct_bytes[case].append(direct[0] - before)
            durable.COLD_BELOW = cold_below
            print(f"rep {i + 1}: " + ", ".join(f"{c} {times[c][-1]:.2f} s" for c in CASES), flush=True)
    finally:
        durable.COLD_BELOW = cold_below
        ckpt.close()
        svc.stop()
        shutil.rmtree(work, ignore_errors=True)
    out = {"command": "python -m bench.cold_restore " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine(), "bytes": nbytes, "reps": args.reps, "cold": not args.keep_cache,
           "file_system": fs, "cases": {}}
    past = times[CASES[0]]
    for case in CASES:
        xs = times[case]
        entry = {"seconds": xs, "median_s": statistics.median(xs), "iqr_spread": iqr_spread(xs),
                 "gib_per_s": nbytes / 2**30 / statistics.median(xs)}
        if case in direct_bytes:  # did the restore read past the page cache at all?
            entry["o_direct_bytes_reps"] = direct_bytes[case]
        if case != CASES[0]:  # how many times as fast reading past the page cache is, rep by rep
            entry["past_cache_speedup_reps"] = [x / p for x, p in zip(xs, past)]
            entry["past_cache_speedup"] = statistics.median(xs) / statistics.median(past)
        out["cases"][case] = entry
        print(f"{case:>24}: median {entry['median_s']:.2f} s ({entry['gib_per_s']:.2f} GiB/s)"
              + (f"; past the page cache is {entry['past_cache_speedup']:.2f}x as fast (rep by rep "
                 f"{min(entry['past_cache_speedup_reps']):.2f}-{max(entry['past_cache_speedup_reps']):.2f})"
                 if case != CASES[0] else ""))
    write_results(args.out, f"cold_restore-{size_label(parse_size(args.size)).replace(' ', '')}", out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("LASTGOOD_LOG_LEVEL", "WARNING")
    sys.exit(main())
