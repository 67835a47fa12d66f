"""The service's peak RSS while ingesting a stream, with and without its memory bounds.

    python -m bench.alloc [SIZE_GIB] [SAVES]   # default 1 GiB, six streamed saves per setting

Each setting gets a fresh service process (environment variables only: no code change);
VmRSS is sampled every 10 ms during each save. The shards are streamed (LASTGOOD_USE_SPOOL=0):
a spooled hand-over allocates nothing per chunk.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import GiB, MiB, RssSampler, Service, build_state

SETTINGS = {"service defaults (8 MiB stream window, 2 malloc arenas)": {},
            "gRPC's BDP-grown window": {"LASTGOOD_GRPC_STREAM_WINDOW": "0"},
            "glibc's arenas": {"LASTGOOD_MALLOC_ARENA_MAX": "0"},
            "neither": {"LASTGOOD_GRPC_STREAM_WINDOW": "0", "LASTGOOD_MALLOC_ARENA_MAX": "0"}}


def main() -> None:
    import lastgood

    os.environ["LASTGOOD_USE_SPOOL"] = "0"
    size = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else GiB
    saves = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    model, opt = build_state(size)
    state = lastgood.TrainState(model=model, optimizer=opt)
    for name, env in SETTINGS.items():
        work = Path(tempfile.mkdtemp(prefix="lastgood-alloc-", dir="/tmp"))
        svc = Service(work / "svc", {"LASTGOOD_GC_INTERVAL": "0", "LASTGOOD_GC_GRACE_SECONDS": "0",
                                     "LASTGOOD_RETENTION": "latest:1,last-good,branch-heads", **env}).start()
        ckpt = lastgood.Checkpointer(svc.url, run="alloc")
        peaks, times = [], []
        try:
            for i in range(saves):
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
