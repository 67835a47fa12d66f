"""Checkpoint metadata at 1,024 ranks: the root manifest and per-file tensor index objects
(docs/architecture.md, "Checkpoint metadata") against the monolithic manifest they replace.

    nice -n 10 python -m bench.manifest [--ranks 1024] [--tensors 1000] [--out bench/results/manifest.json]

A load generator (no torch here or in the service): one process plays every rank over the
real service's gRPC (begin, put one safetensors file of `--tensors` tiny tensors, vote),
then reads the metadata back over REST with the client's RestClient, which counts what it
fetched. Measured:
- commit time: the last rank's vote (it runs the commit) until it hears COMMITTED;
- root size, total and per rank; one index object's size;
- metadata bytes one rank fetches for a same-size restore (the root; rank 0 also the
  last-good view), and for a resharding restore 1,024 -> 512 that needs its two source
  ranks' tensors (root + 2 index objects; today's Checkpointer reads whole files and
  fetches the root alone);
- the monolithic manifest of the same checkpoint (format 1, what every rank fetched before),
  and the time to build it from the catalog's index rows as the old commit did (json.loads
  of every rank's index + canonical dump), measured in this process: the part of the old
  commit that grew with the tensor count;
- the full view for tools (GET /api/v1/checkpoints/{id}): its time and size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.common import ROOT, Service, machine
from lastgood.wire.format import TensorSpec, plan_layout
from lastgood.wire.manifest import Manifest
from lastgood.remote.rest import RestClient
from tests.service.helpers import Client

CHUNK = 1 << 20


def shard(rank: int, tensors: int) -> bytes:
    """One rank's file: `tensors` F32 tensors of 2 elements, FSDP-like names (the same on
    every rank), the rank in the metadata."""
    specs = [TensorSpec(f"model.layers.{i // 10}.p{i % 10}.weight", "F32", (2,)) for i in range(tensors)]
    layout = plan_layout(specs, {"lastgood.format": "1", "rank": str(rank)})
    buf = bytearray(layout.size)
    buf[:layout.data_start] = layout.header
    data = np.arange(2, dtype=np.float32) + rank
    for a, b in layout.offsets.values():
        buf[a:b] = data.tobytes()
    return bytes(buf)


def name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def measure(url: str, grpc_target: str, ranks: int, tensors: int) -> dict:
    run = f"bench-manifest-{ranks}x{tensors}"
    with Client(grpc_target) as c:
        cid = c.begin(run, step=1, world_size=ranks).checkpoint_id
        t0 = time.perf_counter()

        def put(r: int) -> None:
            c.put(cid, r, name(r), shard(r, tensors), chunk=CHUNK)
            c.vote(cid, r, [name(r)], wait=0.0) if r < ranks - 1 else None

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, range(ranks)))
        upload_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        res = c.vote(cid, ranks - 1, [name(ranks - 1)], wait=600.0)
        commit_s = time.perf_counter() - t1
        assert res.status == "COMMITTED", res

    rank0 = RestClient(url)
    rank0.last_good(run)
    root = rank0.manifest(cid)
    same_size_rank0 = rank0.fetched_bytes
    root_bytes = len(rank0.manifest_bytes(cid))
    other = RestClient(url)
    other.manifest(cid)
    same_size = other.fetched_bytes
    reshard = RestClient(url)
    reshard.full_manifest(cid, ranks=[2 * 7, 2 * 7 + 1])  # new rank 7 of 512: old ranks 14 and 15
    reshard_bytes = reshard.fetched_bytes

    tools = RestClient(url)
    t2 = time.perf_counter()
    full_view = tools.get_json(f"/api/v1/checkpoints/{cid}")["manifest"]
    full_view_s = time.perf_counter() - t2
    full = Manifest.from_dict(full_view)
    old = full.as_monolithic()
    old_body = old.to_bytes()
    # the old commit's manifest work: every rank's index row parsed, then the document dumped
    rows = [json.dumps({"data_start": f.data_start, "tensors": f.tensors}, separators=(",", ":"))
            for r in sorted(old.ranks) for f in old.files(r)]
    t3 = time.perf_counter()
    parsed = [json.loads(row) for row in rows]
    rebuilt = Manifest(old.checkpoint_id, old.run, old.step, old.attempt, old.world_size, old.parent_id,
                       old.ranks, old.generation).to_bytes()
    old_build_s = time.perf_counter() - t3
    assert rebuilt == old_body and len(parsed) == ranks
    index_size = root.files(0)[0].index["size"]
    return {
        "ranks": ranks, "tensors_per_rank": tensors, "checkpoint_id": cid,
        "upload_s": round(upload_s, 2), "commit_s": round(commit_s, 3),
        "root_bytes": root_bytes, "root_bytes_per_rank": round(root_bytes / ranks, 1),
        "index_object_bytes": index_size,
        "same_size_restore_bytes_per_rank": same_size, "same_size_restore_bytes_rank0": same_size_rank0,
        "reshard_restore_bytes_per_rank": reshard_bytes,
        "monolithic_bytes": len(old_body),
        "monolithic_bytes_per_tensor": round(len(old_body) / (ranks * tensors), 1),
        "monolithic_build_s": round(old_build_s, 3),
        "full_view_s": round(full_view_s, 2), "full_view_bytes": len(json.dumps(full_view)),
        "same_size_ratio_vs_monolithic": round(len(old_body) / same_size, 1),
        "service_bytes_per_restore_all_ranks": same_size * ranks,
        "monolithic_service_bytes_per_restore_all_ranks": len(old_body) * (ranks + 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "manifest.json")
    args = ap.parse_args()
    env = {"LASTGOOD_LEASE_SECONDS": "900", "LASTGOOD_REAPER_INTERVAL": "30", "LASTGOOD_GC_INTERVAL": "0"}
    with tempfile.TemporaryDirectory(prefix="lastgood-bench-manifest-") as d:
        svc = Service(Path(d) / "svc", env).start(timeout=120)
        try:
            result = measure(svc.url, svc.grpc_target, args.ranks, args.tensors)
        finally:
            svc.stop()
    doc = {"bench": "manifest", "machine": machine(), "result": result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
