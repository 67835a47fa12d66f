"""Restores at another world size: what each rank reads, holds and takes (docs/resharding.md).

    python -m bench.reshard [--layers 8] [--dim 1024] [--block 1MiB] [--out bench/results]

An FSDP2 stack of `layers` Linear(dim, dim) with AdamW (bench/reshard_rank.py; 8 x 1024:
96 MiB of weights and moments, tensors cut in rows across ranks) is saved by torchrun at
one world size and restored at another, against one real service process (range digests
in blocks of at most `--block` bytes, the service's default; each tensor's block is ~1/32
of it), on gloo/CPU. Cases 8 -> 4, 4 -> 8, 4 -> 3, each beside the same-world-size restore
at its new size (saved and restored by that many ranks), plus 4 -> 3 of a checkpoint
without range digests (every old file read whole, as before). Per rank: bytes its
transport received against the bytes of its own new shards, the old files whose metadata
it fetched, peak extra memory during restore() (VmHWM reset before it), restore() time.
Then a projection to 1,024 -> 1,000 ranks from the measured costs.
Writes bench/results/reshard.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from pathlib import Path

from bench.common import MiB, ROOT, Service, free_port, http_json, machine, parse_size

def torchrun(nproc: int, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "bench.reshard_rank", *args]  # a module: bench/ off sys.path
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR", "LASTGOOD_HEARTBEAT_SECONDS": "0"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"torchrun {args[:1]} on {nproc} failed:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}")


def case(svc, work: Path, before: int, after: int, layers: int, dim: int) -> dict:
    run = f"reshard-{before}-{after}-{uuid.uuid4().hex[:6]}"
    out = work / run
    model = [str(layers), str(dim)]
    torchrun(before, ["save", svc.url, run, str(out), *model])
    torchrun(after, ["restore", svc.url, run, str(out), *model])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(after)]
    lg = http_json(f"{svc.url}/api/v1/runs/{run}/last-good")
    with urllib.request.urlopen(f"{svc.url}/api/v1/checkpoints/{lg['id']}/manifest", timeout=60) as r:
        root = len(r.read())  # what every restoring rank fetches first
    return {"before": before, "after": after, "checkpoint_bytes": lg["bytes"], "root_bytes": root, "ranks": ranks}


def summary(c: dict) -> dict:
    rows = []
    for r in c["ranks"]:
        reads = r["reads"]
        overhead = reads.get("replicated_bytes", 0) + reads.get("header_bytes", 0)
        sharded = reads["bytes"] - overhead
        rows.append({"rank": r["rank"], "bytes_read": reads["bytes"], "requests": reads["requests"],
                     "old_files": c["before"], "tensors_per_file": reads.get("tensors_per_file"),
                     "index_bytes": reads.get("index_bytes"), "old_files_read": reads.get("old_files_read"),
                     "new_shard_bytes": r["new_shard_bytes"], "replicated_bytes": reads.get("replicated_bytes"),
                     "header_bytes": reads.get("header_bytes"),
                     "sharded_ratio": round(sharded / r["new_shard_bytes"], 4),
                     "peak_extra_mib": round(r["peak_extra"] / MiB, 1),
                     "bound_mib": round((r["new_shard_bytes"] + overhead + reads.get("window", 0)) / MiB, 1),
                     "restore_s": round(r["restore_s"], 3)})
    return {"before": c["before"], "after": c["after"], "checkpoint_bytes": c["checkpoint_bytes"],
            "root_bytes": c["root_bytes"], "root_bytes_per_old_rank": round(c["root_bytes"] / c["before"], 1),
            "checkpoint_mib": round(c["checkpoint_bytes"] / MiB, 1),
            "max_sharded_ratio": max(x["sharded_ratio"] for x in rows),
            "max_peak_extra_mib": max(x["peak_extra_mib"] for x in rows),
            "restore_s": max(x["restore_s"] for x in rows), "per_rank": rows}


def _overlapping(old: int, new: int, r: int) -> set[int]:
    """The old ranks whose even row chunks overlap new rank r's (rows in units of old * new)."""
    return set(range(r * old // new, -(-(r + 1) * old // new)))


def projection(cases: list[dict], same: list[dict], block: int) -> dict:
    """1,024 -> 1,000 ranks, 1 GiB of state per old rank in 576 tensors (96 layers' weights
    and biases with two moments each), from what the measured cases cost: seconds per byte
    from the same-world-size restores (whole files), seconds per ranged request from the
    resharding restores (their time less their bytes at that rate, over their requests),
    header bytes per tensor and root bytes per old file as measured (the bench's model has
    the same two shapes a layer). Each rank fetches the root, then the index object and the
    header of each old file it reads: those its new shard overlaps (2 for nearly every
    rank, 3 for a few) and its source of replicated state (old rank min(rank, 1,023)); one
    range per piece (a stored shard's rows: one per tensor per overlapping file), the
    replicated state in one. Per tensor block by ranges.block_for, half a block of
    rounding per piece on average (one cut end)."""
    from statistics import mean, median

    from lastgood.wire.ranges import block_for

    per_byte = median(r["restore_s"] / r["bytes_read"] for c in same for r in c["per_rank"])
    per_req = median(max(r["restore_s"] - r["bytes_read"] * per_byte, 0.0) / r["requests"]
                     for c in cases for r in c["per_rank"] if r["requests"])
    big = max(cases, key=lambda c: c["before"])
    ref = big["per_rank"][0]
    old, new, state, tensors = 1024, 1000, 1024 * MiB, 576
    header_per_tensor = ref["header_bytes"] / ref["old_files_read"] / ref["tensors_per_file"]
    root = old * big["root_bytes_per_old_rank"]
    overlap = mean(len(_overlapping(old, new, r)) for r in range(new))
    files = mean(len(_overlapping(old, new, r) | {min(r, old - 1)}) for r in range(new))
    need = state * old / new
    chunk = state // tensors  # a tensor's stored piece, on average
    out = {"old_ranks": old, "new_ranks": new, "state_per_old_rank_gib": 1, "tensors_per_file": tensors,
           "seconds_per_request": round(per_req, 5), "seconds_per_gib": round(per_byte * 1024 * MiB, 2),
           "requests_per_rank_counted": "the root, an index object and a header per old file read, "
                                        "a range per piece, one for the replicated state",
           "header_bytes_per_tensor": round(header_per_tensor, 1), "root_bytes": round(root),
           "old_files_read_per_rank": round(files, 3), "overlapping_old_files_per_rank": round(overlap, 3),
           "whole_files_read_per_rank_gib": old, "by_block": []}
    for cap in sorted({block, 16 * 1024, 1 * MiB, 64 * MiB}):
        b = block_for(chunk, cap)
        segments = tensors * -(-chunk // b)
        pieces = tensors * overlap
        rounding = pieces * b / 2
        headers = files * tensors * header_per_tensor
        index = files * (tensors * 78 + (segments + 1) * 36)  # 78 B a tensor (architecture.md), 36 a digest
        total = need + rounding + headers + index + root
        requests = 1 + 2 * files + pieces + 1
        out["by_block"].append({
            "block_bytes": cap, "tensor_block_bytes": b, "needed_mib": round(need / MiB),
            "rounding_mib": round(rounding / MiB, 1), "headers_mib": round(headers / MiB, 2),
            "index_objects_mib": round(index / MiB, 2), "root_mib": round(root / MiB, 2),
            "ratio_to_needed": round(total / need, 3), "requests_per_rank": round(requests),
            "store_requests_total": round(requests * new),
            "seconds_per_rank": round(requests * per_req + total * per_byte, 1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--block", type=parse_size, default=1 * MiB)  # the service's default cap
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--smoke", action="store_true", help="4 -> 3 of a tiny model only, into --out as smoke.json")
    a = ap.parse_args()
    plans = ((("ranges", a.block, [(4, 3), (3, 3)]),) if a.smoke else
             (("ranges", a.block, [(8, 4), (4, 8), (4, 3), (4, 4), (8, 8), (3, 3)]),
              ("whole files (no range digests)", 0, [(4, 3)])))
    work = Path(tempfile.mkdtemp(prefix="lastgood-reshard-", dir=a.workdir))
    result = {"machine": machine(), "layers": a.layers, "dim": a.dim, "block_bytes": a.block, "cases": []}
    try:
        env = {"LASTGOOD_GC_INTERVAL": "0", "LASTGOOD_LEASE_SECONDS": "120"}
        for label, block, plan in plans:
            svc = Service(work / f"svc-{block}", {**env, "LASTGOOD_RANGE_BLOCK_BYTES": str(block)}).start()
            try:
                for before, after in plan:
                    s = summary(case(svc, work, before, after, a.layers, a.dim))
                    s.update(label=label, block_bytes=block, layers=a.layers)
                    result["cases"].append(s)
                    print(f"{label:32} {before}->{after}: max sharded ratio {s['max_sharded_ratio']:.3f}, "
                          f"peak extra {s['max_peak_extra_mib']} MiB, restore {s['restore_s']} s", flush=True)
            finally:
                svc.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    same = {c["after"]: c["restore_s"] for c in result["cases"] if c["before"] == c["after"]}
    for c in result["cases"]:
        if c["before"] != c["after"] and c["after"] in same:
            c["time_vs_same_world"] = round(c["restore_s"] / same[c["after"]], 2)
    ranged = [c for c in result["cases"] if c["label"] == "ranges" and c["before"] != c["after"]]
    result["projection"] = projection(ranged, [c for c in result["cases"] if c["before"] == c["after"]], a.block)
    result["machine"]["loadavg_end"] = os.getloadavg()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / ("smoke.json" if a.smoke else "reshard.json")).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["projection"], indent=1))


if __name__ == "__main__":
    main()
