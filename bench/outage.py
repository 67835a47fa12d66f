"""How long save() blocks the trainer while the service is away, against the plain CPU copy.

    python -m bench.outage [SIZE] [SAVES]     # default 256MiB, 12 saves during the outage

A real service process; a GPT-style state of SIZE (bench.common.build_state); one
Checkpointer with its default two staging buffers. After two warm saves (the buffers
touched), six saves 0.2 s apart with the service up, then the service is SIGKILLed and
the "trainer" calls save() SAVES times, 0.2 s apart; each save() is preceded by a plain
CPU copy of the same state (run.CopyFloor), measured under the same load (the upload
thread is busy meanwhile). Then the service is restarted on the same ports and the last
save is waited for. Target: the worst save() during the outage, beyond any wait for a
free staging buffer (the pool records it), <= 1.5x the copy right before it; the
healthy phase is the comparison. Writes bench/results/outage.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, Service, build_state, machine, median, parse_size, size_label, state_tensors
from bench.peers import CopyFloor


def main(argv: list[str]) -> dict:
    import lastgood

    size = parse_size(argv[0]) if argv else 256 * 1024 * 1024
    n_outage = int(argv[1]) if len(argv) > 1 else 12
    model, opt = build_state(size)
    state = lastgood.TrainState(model=model, optimizer=opt)
    floor = CopyFloor(state_tensors(model, opt))
    with tempfile.TemporaryDirectory(prefix="lastgood-outage-") as work:
        svc = Service(Path(work) / "svc", {"LASTGOOD_GC_INTERVAL": "0", "LASTGOOD_LEASE_SECONDS": "120"}).start()
        try:
            ckpt = lastgood.Checkpointer(svc.url, run="bench-outage", attempt="bench")
            for step in (0, 1):  # warm: both staging buffers allocated and touched
                ckpt.save(step, state)
                ckpt.wait()
            def saves(first: int, n: int) -> list[dict]:
                rows = []
                for i in range(n):
                    copy = floor.once()  # the floor, measured right before, under the same load
                    t0 = time.perf_counter()
                    ckpt.save(first + i, state)
                    block = time.perf_counter() - t0
                    rows.append({"save_s": block, "buffer_wait_s": ckpt._pool.last_wait, "copy_s": copy})
                    time.sleep(0.2)  # the training step between saves
                return rows

            healthy = saves(2, 6)
            ckpt.wait()
            svc.kill()
            outage = saves(10, n_outage)
            svc.restart(timeout=60)
            t0 = time.perf_counter()
            ckpt.wait()
            recovered = time.perf_counter() - t0
            stats = ckpt.stats
            last_good = lastgood.datapath.transport.RestClient(svc.url).last_good("bench-outage")
            ckpt.close()
        finally:
            svc.stop()
    def summary(rows: list[dict]) -> dict:
        # "once a buffer is free": the time save() blocks beyond waiting for a staging buffer
        ratios = [(r["save_s"] - r["buffer_wait_s"]) / r["copy_s"] for r in rows]
        return {"saves": len(rows), "worst_save_s": round(max(r["save_s"] for r in rows), 4),
                "worst_buffer_wait_s": round(max(r["buffer_wait_s"] for r in rows), 4),
                "median_copy_s": round(median([r["copy_s"] for r in rows]), 4),
                "worst_vs_copy": round(max(ratios), 3), "median_vs_copy": round(median(ratios), 3),
                "rows": [{k: round(v, 4) for k, v in r.items()} for r in rows]}

    during, before = summary(outage), summary(healthy)
    result = {
        "size": size_label(size), "state_bytes": sum(t.nbytes for t in state_tensors(model, opt)),
        "interval_s": 0.2,
        "target": "worst save() during the outage, beyond waiting for a free staging buffer, <= 1.5x the plain CPU "
                  "copy measured right before it",
        "outage": during, "healthy": before,
        "met": during["worst_vs_copy"] <= 1.5,
        "wait_after_restart_s": round(recovered, 2),
        "client_stats": stats,
        "last_good_step_after_restart": last_good["step"] if last_good else None,
        "machine": machine(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    out = ROOT / "bench/results/outage.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name in ("healthy", "outage"):
        r = result[name]
        print(f"{name:8s} worst save() {r['worst_save_s']:.3f} s (buffer wait {r['worst_buffer_wait_s']:.3f} s), "
              f"median copy {r['median_copy_s']:.3f} s: worst {r['worst_vs_copy']:.2f}x, median {r['median_vs_copy']:.2f}x")
    print(f"target met: {result['met']}; stats {stats}; last-good after restart: step "
          f"{result['last_good_step_after_restart']}; load {result['machine']['loadavg_start']}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
