"""What limits a large write on this machine: the disk, or the page cache's memory?

    python -m bench.pagecache --size 4G --reps 4

The same bytes written with 1 MiB `os.write`s and an `fsync`, as the bench's raw ceiling
writes them (bench/run.py), three ways, alternating rep by rep, each after `settle()` and
the clean page cache dropped (bench/common.py), as before every save case of `make bench`:

  plain        write, start each 8 MiB piece's writeback (lastgood.common.durable.Writeback's
               call), fsync: every byte takes a page-cache page, as every save did before 2026-12-02
  drop-behind  the same through the service's lastgood.common.durable.DropBehind with nothing
               kept: what lies 32 MiB behind the writer is waited for on the disk and
               dropped (POSIX_FADV_DONTNEED), so the file recycles about 32 MiB of page
               cache instead of taking a page per byte (the results of 2026-12-02 were
               measured with the same calls written out here)
  plain-late   plain, started 3 s after the drop instead of at once

Why: on this VM, memory freed for a while is handed back to the host (free page
reporting), and a page taken from it costs a host fault. The drop frees the page cache at
once; about 1.8 s later a reporting pass hands part of it back
(/sys/module/page_reporting/parameters/reported_kib, read before and after each case). A
1 GiB write ends before that pass, a 4 GiB one runs into it. drop-behind measures the
disk without the page cache's memory in the way; plain-late measures a start after the
pass. Writes bench/results/pagecache-<size>.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (GiB, MiB, ROOT, drop_clean_cache, iqr_spread, machine, order_of, parse_size, settle,
                          size_label, write_results)
from lastgood.common import durable

PIECE = 8 * MiB
REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def reported_kib() -> int | None:
    try:
        return int(REPORTED.read_text())
    except (OSError, ValueError):
        return None


def write(path: Path, nbytes: int, drop_behind: bool) -> float:
    block = memoryview(os.urandom(MiB))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    writeback = durable.Writeback(fd)
    behind = durable.DropBehind(fd, 0 if drop_behind else -1)  # the service's own drop-behind
    t0 = time.perf_counter()
    try:
        off = 0
        while off < nbytes:
            off += os.write(fd, block[:min(MiB, nbytes - off)])
            if off % PIECE == 0 or off == nbytes:
                start = (off - 1) // PIECE * PIECE
                writeback.start(start, off - start)
                behind.advance(off)
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        behind.close()
        writeback.close()
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pagecache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="4G")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--late", type=float, default=3.0, help="seconds between the drop and plain-late's start")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--keep-cache", action="store_true", help="do not drop the clean page cache before each case")
    args = ap.parse_args(argv)
    nbytes = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="lastgood-pagecache-", dir="/tmp"))
    cases = {"plain": (False, 0.0), "drop-behind": (True, 0.0), "plain-late": (False, args.late)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    reported: dict[str, list] = {k: [] for k in cases}
    try:
        for i in range(args.reps):
            names = list(cases)
            for name in order_of(names, i):
                drop_behind, late = cases[name]
                settle()
                if not args.keep_cache:
                    drop_clean_cache()
                r0 = reported_kib()
                time.sleep(late)
                r1 = reported_kib()
                times[name].append(write(work / "f.bin", nbytes, drop_behind))
                r2 = reported_kib()
                reported[name].append(None if r0 is None else {"before_mib": (r1 - r0) // 1024,
                                                               "during_mib": (r2 - r1) // 1024})
            print(f"rep {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    finally:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    out = {"command": "python -m bench.pagecache " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine(), "bytes": nbytes, "reps": args.reps, "cases": {}}
    for name, xs in times.items():
        out["cases"][name] = {"seconds": xs, "median_s": statistics.median(xs), "iqr_spread": iqr_spread(xs),
                              "gib_per_s": nbytes / GiB / statistics.median(xs),
                              "vs_plain_reps": [p / x for p, x in zip(times["plain"], xs)],
                              "reported_by_the_vm": reported[name]}
        print(f"{name:>12}: median {statistics.median(xs):.2f} s ({nbytes / GiB / statistics.median(xs):.2f} GiB/s), "
              f"plain / it rep by rep {', '.join(f'{r:.2f}' for r in out['cases'][name]['vs_plain_reps'])}")
    write_results(args.out, f"pagecache-{size_label(nbytes).replace(' ', '')}", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
