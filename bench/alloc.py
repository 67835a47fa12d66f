"""The service's peak RSS while ingesting, under three glibc malloc settings.

    python -m bench.alloc [SIZE_GIB]    # default 1; six synchronous saves per setting

Each setting gets a fresh service process (environment variables only: no code change);
VmRSS is sampled every 10 ms during each save.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import GiB, MiB, RssSampler, Service, build_state

SETTINGS = {"default": {}, "MALLOC_ARENA_MAX=2": {"MALLOC_ARENA_MAX": "2"},
            "MALLOC_MMAP_THRESHOLD_=1MiB": {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}}


def main() -> None:
    import lastgood

    size = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else GiB
    model, opt = build_state(size)
    state = lastgood.TrainState(model=model, optimizer=opt)
    for name, env in SETTINGS.items():
        work = Path(tempfile.mkdtemp(prefix="lastgood-alloc-", dir="/tmp"))
        svc = Service(work / "svc", {"LASTGOOD_GC_INTERVAL": "0", "LASTGOOD_GC_GRACE_SECONDS": "0",
                                     "LASTGOOD_RETENTION": "latest:1,last-good,branch-heads", **env}).start()
        ckpt = lastgood.Checkpointer(svc.url, run="alloc")
        peaks, times = [], []
        try:
            for i in range(6):
                with RssSampler(svc.pid) as rss:
                    t0 = time.perf_counter()
                    ckpt.save(i, state)
                    ckpt.wait()
                    times.append(time.perf_counter() - t0)
                peaks.append(round(rss.peak / MiB))
                svc.gc()
        finally:
            ckpt.close()
            svc.stop()
            shutil.rmtree(work, ignore_errors=True)
        print(f"{name}: RSS peak per save {peaks} MiB; save times {[round(t, 2) for t in times]} s", flush=True)


if __name__ == "__main__":
    main()
