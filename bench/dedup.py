"""DDP's replicated state written once (docs/replicated.md): bytes stored and bytes each
rank uploads, against the state's size, with and without dedup, and through DCP.

    python -m bench.dedup [--ranks 4] [--layers 8] [--dim 1024] [--out bench/results]

A DDP stack of `layers` Linear(dim, dim) with AdamW after one step (8 x 1024: 96 MiB of
weights and moments per rank), saved once by `ranks` torchrun ranks (gloo/CPU) against one
real service process, three ways in the same run: the Checkpointer (dedup on, the default),
the Checkpointer with LASTGOOD_DEDUP=0 (every rank writes its full state, as before), and
DCP's `dcp.save` through `lastgood.dcp.StorageWriter` (DCP's own planner dedups). Figures:
the catalog's bytes of the checkpoint over the state's size (one rank's weights and
moments), each rank's uploaded file over the state's size, the save time (from save() to
the acknowledged commit, the slowest rank). Targets: stored <= 1.05x, per rank <= 0.3x.
Writes bench/results/dedup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from bench.common import MiB, ROOT, Service, free_port, http_json, machine

CASES = (("dedup", "checkpointer", {"LASTGOOD_DEDUP": "1"}),
         ("no dedup (LASTGOOD_DEDUP=0)", "checkpointer", {"LASTGOOD_DEDUP": "0"}),
         ("DCP StorageWriter", "dcp", {}))


def case(svc, work: Path, label: str, mode: str, env: dict, ranks: int, layers: int, dim: int) -> dict:
    run = f"dedup-{mode}-{uuid.uuid4().hex[:6]}"
    out = work / run
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={free_port()}",
           "-m", "bench.dedup_rank", mode, svc.url, run, str(out), str(layers), str(dim)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR", **env}
    res = subprocess.run(cmd, env=full_env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{label} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")
    per = [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(ranks)]
    state = per[0]["state_bytes"]
    lg = http_json(f"{svc.url}/api/v1/runs/{run}/last-good")
    view = http_json(f"{svc.url}/api/v1/checkpoints/{lg['id']}")
    uploaded = [sum(f["size"] for f in r["files"]) for r in sorted(view["manifest"]["ranks"], key=lambda r: r["rank"])]
    return {"label": label, "ranks": ranks, "state_bytes": state, "state_mib": round(state / MiB, 1),
            "stored_bytes": lg["bytes"], "stored_vs_state": round(lg["bytes"] / state, 4),
            "uploaded_bytes_per_rank": uploaded,
            "max_uploaded_vs_state": round(max(uploaded) / state, 4),
            "min_uploaded_vs_state": round(min(uploaded) / state, 4),
            "save_s": round(max(p["save_s"] for p in per), 2), "loadavg": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--smoke", action="store_true", help="a tiny model, into --out as smoke-dedup.json")
    a = ap.parse_args()
    if a.smoke:
        a.layers, a.dim = 4, 128
    work = Path(tempfile.mkdtemp(prefix="lastgood-dedup-", dir=a.workdir))
    result = {"machine": machine(), "ranks": a.ranks, "layers": a.layers, "dim": a.dim, "cases": []}
    try:
        svc = Service(work / "svc", {"LASTGOOD_GC_INTERVAL": "0", "LASTGOOD_LEASE_SECONDS": "120"}).start()
        try:
            for label, mode, env in CASES:
                c = case(svc, work, label, mode, env, a.ranks, a.layers, a.dim)
                result["cases"].append(c)
                print(f"{label:30} stored {c['stored_vs_state']:.3f}x the state, each rank uploads "
                      f"{c['min_uploaded_vs_state']:.3f}..{c['max_uploaded_vs_state']:.3f}x, save {c['save_s']} s "
                      f"(load {c['loadavg'][0]:.1f})", flush=True)
        finally:
            svc.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by = {c["label"]: c for c in result["cases"]}
    on, off = by[CASES[0][0]], by[CASES[1][0]]
    result["same_run_ratios"] = {"stored_dedup_vs_no_dedup": round(on["stored_bytes"] / off["stored_bytes"], 4),
                                 "save_time_dedup_vs_no_dedup": round(on["save_s"] / off["save_s"], 3)}
    result["targets"] = {"stored_vs_state_max": 1.05, "uploaded_per_rank_vs_state_max": 0.3,
                         "met": on["stored_vs_state"] <= 1.05 and on["max_uploaded_vs_state"] <= 0.3}
    result["machine"]["loadavg_end"] = os.getloadavg()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / ("smoke-dedup.json" if a.smoke else "dedup.json")).write_text(json.dumps(result, indent=1))
    print(json.dumps({**result["same_run_ratios"], **result["targets"]}))


if __name__ == "__main__":
    main()
