"""1,024 ranks on 128 hosts writing straight to S3: a model driven by measured control-plane costs.

    nice -n 10 .venv/bin/python -m bench.cluster [--ranks 16,64,256] [--reps 2]
    .venv/bin/python -m bench.cluster --model-only      # the model again, from the committed measurements

No machine here has 1,024 GPUs, so the figure is a model, and what drives it is measured:

1. **Measure** (one process plays N ranks against a real service process, direct S3 uploads
   to moto's S3 server in this process, `peer` verification; a few rank counts): each step
   of a save runs as a phase of its own, every rank at once through a pool of threads, and
   the service's CPU seconds (/proc/<pid>/stat), the phase's wall time, the store requests
   (moto's request log: the service's own and the trainers' presigned ones, apart) and the
   catalog's transactions (/metrics) are taken around it. Phases: begin, grant (+ the part
   PUTs, which go to the store), hand-over, vote, peer check (assignment, the presigned
   read-back, report) of every rank but the last, the last rank's check (whose report
   commits: the commit is that call less an ordinary check), every rank's outcome call.
   Then the checkpoint's catalog rows. Files are tiny (one part): what a call costs the
   service does not depend on the file's size (no byte passes through it) but for the
   presigning of one URL a part, timed here on its own.
2. **Model** (`model`): per-call CPU fitted as a + b·N over the measured rank counts and
   taken at 1,024; the commit's the same way. A checkpoint of `--tb` TB over 1,024 ranks on
   128 hosts (8 a host), one file a rank, parts of 64 MiB, at aggregate store bandwidths
   of 10, 50, 200 GB/s: the time from the last rank's upload to COMMITTED, the service CPU,
   the catalog rows and the store requests per checkpoint. The assumptions are in
   `ASSUME` and in bench/README.md beside the table.

Results: bench/results/cluster.json (measurements, fits, the model's table).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs

from bench.common import Service, machine, median
from bench.probes import Catalog, catalog_transactions, cpu_seconds

MiB = 1024 * 1024
GB = 1e9
OUT = Path(__file__).parent / "results" / "cluster.json"
FILE = "rank{:05d}.safetensors"

# What the model takes as given (bench/README.md says why each is what it is).
ASSUME = {
    "ranks": 1024,
    "hosts": 128,
    "files_per_rank": 1,
    "part_mib": 64,                       # LASTGOOD_DIRECT_S3_PART_SIZE's default
    "service_cores": 1.0,                 # one Python process: the GIL serialises its CPU-bound work
    "rest_threads": 40,                   # anyio's default thread pool: the REST calls that wait on the store
    "store_call_latency_s": 0.03,         # one S3 metadata call (ListParts, HEAD, a ranged GET, a small PUT)
    "complete_latency_s": 0.5,            # CompleteMultipartUpload of a ~1 GB, 15-part object
    "host_nic_gbps": 100,                 # per host, Gb/s: 128 x 12.5 GB/s, never the limit below
    "bandwidths_gb_s": [10, 50, 200],     # aggregate store bandwidth, both directions alike
}


# ---------------------------------------------------------------------------- store requests
# The hand-over's two ranged GETs of the safetensors header (grants._index: its length, then
# the header) are missing from moto's request log, which logs a streamed answer only once
# its connection closes; they are added from the code.
HEADER_GETS = 2


class StoreLog(logging.Handler):
    """Counts the S3 requests moto's server logs (werkzeug), by who made them: the trainers'
    presigned URLs (signed in the query string) and the service's own calls."""

    LINE = re.compile(r'"([A-Z]+) (/[^ ]*) HTTP/')

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counting = threading.Lock()  # not `lock`: logging's own, held around emit
        self.counts: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        m = self.LINE.search(record.getMessage())
        if not m:
            return
        method, path = m.groups()
        keys = set(parse_qs(path.partition("?")[2], keep_blank_values=True))
        who = "trainer" if "X-Amz-Signature" in keys else "service"
        kind = ("part" if "partNumber" in keys else "uploads" if "uploads" in keys
                else "upload" if "uploadId" in keys else "object")
        with self.counting:
            self.counts[f"{who} {method} {kind}"] += 1

    def take(self) -> dict:
        with self.counting:
            out, self.counts = dict(self.counts), Counter()
        return out


# ---------------------------------------------------------------------------- measuring
class Ranks:
    """N simulated ranks of one checkpoint, run through a pool of threads (one Transport each)."""

    def __init__(self, url: str, threads: int = 8) -> None:
        from lastgood.datapath.transport import Transport

        self.pool = ThreadPoolExecutor(threads)
        self.local = threading.local()
        self.url, self._transport = url, Transport
        self.all: list = []
        self.lock = threading.Lock()

    def t(self):
        t = getattr(self.local, "t", None)
        if t is None:
            t = self.local.t = self._transport(self.url, spool=False)
            with self.lock:
                self.all.append(t)
        return t

    def run(self, fn, ranks) -> list:
        return list(self.pool.map(lambda r: fn(self.t(), r), ranks))

    def close(self) -> None:
        self.pool.shutdown()
        for t in self.all:
            t.close()


def one_checkpoint(svc, ranks: Ranks, catalog: Catalog, store_log: StoreLog, run: str, step: int, n: int) -> dict:
    from lastgood.datapath import directs3, peer
    from tests.service.helpers import make_shard

    files = {r: make_shard(r, seed=step, n=2) for r in range(n)}
    prepared = {r: directs3.prepare(files[r], 5 * MiB) for r in range(n)}
    state: dict = {}
    phases: dict = {}

    def phase(name: str, fn, which) -> None:
        store_log.take()
        tx0, c0, t0 = catalog_transactions(svc.url), cpu_seconds(svc.pid), time.perf_counter()
        ranks.run(fn, which)
        wall, cpu = time.perf_counter() - t0, cpu_seconds(svc.pid) - c0
        phases[name] = {"calls": len(which), "service_cpu_s": round(cpu, 4), "wall_s": round(wall, 4),
                        "store_requests": store_log.take(),
                        "catalog_transactions": {k: v - tx0.get(k, 0) for k, v in catalog_transactions(svc.url).items()
                                                 if v - tx0.get(k, 0)}}

    def begin(t, r):
        state["cid"] = t.begin(run, step, n, None, "a1", r).checkpoint_id

    def grant(t, r):
        state[r] = directs3.upload(t, state["cid"], r, FILE.format(r), files[r], prepared[r])

    def hand_over(t, r):
        directs3.hand_over(t, state["cid"], r, FILE.format(r), state[r])

    def vote(t, r):
        assert t.commit_rank(state["cid"], r, [FILE.format(r)], wait=0).status == "PENDING"

    def check(t, r):
        peer.check(t, None, state["cid"], r, deadline=time.monotonic() + 600)

    def outcome(t, r):
        assert t.outcome(state["cid"], wait=0)["status"] == "COMMITTED"

    everyone = list(range(n))
    phase("begin", begin, everyone)
    phase("grant", grant, everyone)
    phase("hand_over", hand_over, everyone)
    phase("vote", vote, everyone)
    # rank r checks rank r+1: every rank but the last reports first; the last report commits
    phase("check", check, everyone[:-1])
    phase("check_and_commit", check, everyone[-1:])
    phase("outcome", outcome, everyone)
    cid = state["cid"]
    last_vote, committed = catalog.times(cid)
    return {"ranks": n, "checkpoint_id": cid, "phases": phases, "catalog_rows": catalog.rows(cid),
            "last_vote_to_committed_s": round(committed - last_vote, 3), "loadavg_1m": round(os.getloadavg()[0], 2)}


def presign_cpu_s(n: int = 2000) -> float:
    """CPU seconds the service spends presigning one part's URL (the grant's per-part cost)."""
    from lastgood_service.blobstore.s3 import S3BlobStore
    from lastgood_service.blobstore.s3direct import S3Direct

    store = S3BlobStore.__new__(S3BlobStore)  # presigning needs the bucket, prefix and keys alone
    store.bucket, store.prefix, store.access_key, store.secret_key = "b", "", "k", "s" * 40
    store.endpoint, store.secure, store.region = "127.0.0.1:9000", False, "us-east-1"
    d = S3Direct(store)
    c0 = time.process_time()
    for i in range(n):
        d.presign_part("ckpt/1-abc/r00001/" + "0" * 32, "upload-id", i % 10000 + 1, "AAAAAA==", 3600)
    return (time.process_time() - c0) / n


def measure(rank_counts: list[int], reps: int, idle_s: float = 10.0) -> dict:
    from moto.server import ThreadedMotoServer

    from tests.s3 import S3Server

    store_log = StoreLog()
    wz = logging.getLogger("werkzeug")
    wz.setLevel(logging.INFO)
    wz.addHandler(store_log)
    wz.propagate = False
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = S3Server(f"{host}:{port}")
    out: dict = {"runs": []}
    try:
        with tempfile.TemporaryDirectory(prefix="lastgood-bench-cluster-") as tmp:
            env = {**s3.env(s3.make_bucket("cluster")), "LASTGOOD_DIRECT_S3": "true", "LASTGOOD_VERIFICATION": "peer",
                   "LASTGOOD_DIRECT_S3_PART_SIZE": str(5 * MiB), "LASTGOOD_LEASE_SECONDS": "900",
                   "LASTGOOD_REAPER_INTERVAL": "30", "LASTGOOD_GC_INTERVAL": "0", "LASTGOOD_MAX_WORLD_SIZE": "4096"}
            svc = Service(Path(tmp) / "svc", env).start(timeout=180)
            catalog = Catalog(f"sqlite:///{Path(tmp) / 'svc' / 'catalog.db'}")
            ranks = Ranks(svc.url)
            try:
                c0 = cpu_seconds(svc.pid)
                time.sleep(idle_s)  # what the idle service burns (reaper, notifier): taken out of each phase
                out["idle_service_cpu_s_per_s"] = round((cpu_seconds(svc.pid) - c0) / idle_s, 4) if idle_s else 0.0
                step = 0
                for rep in range(reps):
                    for n in (rank_counts if rep % 2 == 0 else rank_counts[::-1]):
                        step += 1
                        r = one_checkpoint(svc, ranks, catalog, store_log, "cluster", step, n)
                        print(json.dumps({"ranks": n, "loadavg": r["loadavg_1m"],
                                          **{k: v["service_cpu_s"] for k, v in r["phases"].items()}}), flush=True)
                        out["runs"].append(r)
            finally:
                ranks.close()
                catalog.close()
                svc.stop()
    finally:
        server.stop()
        wz.removeHandler(store_log)
    out["presign_cpu_s_per_part"] = round(presign_cpu_s(), 7)
    return out


# ---------------------------------------------------------------------------- the model
GROWS = 1.25  # a per-call cost this much higher at the largest rank count than at the one before grows with N


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares a + b·N through (N, y); b is held at >= 0 (a cost never shrinks with N)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx else 0.0
    return my - b * mx, b


def per_call(measured: dict) -> dict:
    """Per-call service CPU (net of the idle service's background) at each rank count
    (median over the repetitions), the commit's on its own (the last check less an
    ordinary one). What the model takes: each call's cost at the largest rank count
    measured (the most calls per phase, so the least rounding of /proc's 10 ms ticks; the
    catalog lookups behind most calls are by key, so they do not grow with the ranks)
    unless it grew by more than GROWS between the two largest counts: then its fit a + b·N
    at 1,024; and the commit's total fitted as a + b·N (it reads every vote and file)."""
    idle = measured.get("idle_service_cpu_s_per_s", 0.0)
    by_n: dict[int, dict[str, list[float]]] = {}
    for r in measured["runs"]:
        p = r["phases"]
        cost = {k: max(0.0, (v["service_cpu_s"] - idle * v["wall_s"])) / v["calls"] for k, v in p.items()}
        cost["commit"] = max(0.0, cost.pop("check_and_commit") - cost["check"])
        for k, v in cost.items():
            by_n.setdefault(r["ranks"], {}).setdefault(k, []).append(v)
    table = {n: {k: median(v) for k, v in d.items()} for n, d in sorted(by_n.items())}
    ns = sorted(table)
    used = {k: v for k, v in table[ns[-1]].items() if k != "commit"}
    growth = {k: round(table[ns[-1]][k] / table[ns[-2]][k], 2) if len(ns) > 1 and table[ns[-2]][k] else None
              for k in used}
    grows = sorted(k for k, g in growth.items() if g is not None and g > GROWS)
    for k in grows:  # a call that costs more with more ranks: taken at 1,024 from its fit, not at the largest N
        a, b = fit([(n, d[k]) for n, d in table.items()])
        used[k] = a + b * ASSUME["ranks"]
    a, b = fit([(n, d["commit"]) for n, d in table.items()])
    return {"per_call_cpu_s": {str(n): {k: round(v, 5) for k, v in d.items()} for n, d in table.items()},
            "used_per_call_cpu_s": {k: round(v, 5) for k, v in used.items()},
            "growth_between_the_two_largest_rank_counts": growth, "fitted_as_growing": grows,
            "commit_fit": {"a": round(a, 5), "b_per_rank": round(b, 8)}}


def store_requests_per_rank(measured: dict) -> dict:
    """Store requests per rank and file, by phase and who makes them (largest rank count)."""
    run = max(measured["runs"], key=lambda r: r["ranks"])
    n = run["ranks"]
    out: Counter = Counter()
    for ph, v in run["phases"].items():
        for k, c in v["store_requests"].items():
            out[f"{ph}: {k}"] += c
    return {k: round(c / n, 3) for k, c in sorted(out.items())}


def catalog_rows(measured: dict, n: int) -> dict:
    pts: dict[str, list[tuple[int, float]]] = {}
    for r in measured["runs"]:
        for k, v in r["catalog_rows"].items():
            pts.setdefault(k, []).append((r["ranks"], v))
    rows = {k: round(a + b * n) for k, (a, b) in ((k, fit(p)) for k, p in pts.items())}
    rows["total"] = sum(rows.values())
    return rows


def model(measured: dict, tb: float = 1.0, assume: dict = ASSUME) -> dict:
    n, hosts = assume["ranks"], assume["hosts"]
    pc = per_call(measured)
    f = dict(pc["used_per_call_cpu_s"])
    f["commit"] = pc["commit_fit"]["a"] + pc["commit_fit"]["b_per_rank"] * n  # the commit's total at n
    file_bytes = tb * 1e12 / (n * assume["files_per_rank"])
    parts = math.ceil(file_bytes / (assume["part_mib"] * MiB))
    grant = f["grant"] + (parts - 1) * measured["presign_cpu_s_per_part"]
    per_rank = {"begin": f["begin"], "grant": grant, "hand_over": f["hand_over"], "vote": f["vote"],
                "check": f["check"], "outcome": f["outcome"]}
    cpu_total = n * sum(per_rank.values()) + f["commit"]
    cpu_store_mode = cpu_total - n * per_rank["check"]
    lat, cores, threads = assume["store_call_latency_s"], assume["service_cores"], assume["rest_threads"]
    # the hand-over's store calls, waited for on a REST thread: list parts, list uploads, HEAD,
    # two ranged GETs of the header, the index object's PUT, and the completion
    hand_over_wait = 6 * lat + assume["complete_latency_s"]
    # after the last upload, in the worst case (fair sharing: every rank's upload ends at once),
    # the service has every rank's hand-over, vote (and check) and outcome before it
    burst_cpu = {"store": n * (per_rank["hand_over"] + per_rank["vote"] + per_rank["outcome"]) + f["commit"]}
    burst_cpu["peer"] = burst_cpu["store"] + n * per_rank["check"]
    hand_over_threads = n * hand_over_wait / threads      # 1,024 hand-overs through 40 threads
    table = []
    for bw in assume["bandwidths_gb_s"]:
        upload_s = tb * 1e12 / (bw * GB)
        host_gb_s = bw / hosts
        assert host_gb_s <= assume["host_nic_gbps"] / 8, "a host's NIC would be the limit"
        row = {"bandwidth_gb_s": bw, "upload_s": round(upload_s, 1), "per_host_gb_s": round(host_gb_s, 3)}
        for mode in ("store", "peer"):
            readback = upload_s if mode == "peer" else 0.0     # every byte read once more, at the same bandwidth
            # the hand-overs are bound by the CPU or by the threads waiting on the store, whichever is slower
            ho = max(n * per_rank["hand_over"] / cores, hand_over_threads)
            rest = (n * per_rank["vote"] + (n * per_rank["check"] if mode == "peer" else 0) + f["commit"]) / cores
            to_committed = ho + readback + rest
            heard = to_committed + n * per_rank["outcome"] / cores
            row[mode] = {"last_upload_to_committed_s": round(to_committed, 2),
                         "of_it_read_back_s": round(readback, 2),
                         "last_upload_to_every_rank_heard_s": round(heard, 2),
                         "overhead_vs_upload": round(to_committed / upload_s, 3)}
        table.append(row)
    rows = catalog_rows(measured, n)
    big = max(measured["runs"], key=lambda r: r["ranks"])  # catalog transactions: per rank, by phase
    tx = {ph: sum(v["catalog_transactions"].values()) / v["calls"] for ph, v in big["phases"].items()}
    commit_tx = tx.pop("check_and_commit") - tx["check"]  # the last check's, less an ordinary one's: once
    tx_peer = n * sum(tx.values()) + commit_tx
    tx_store = n * sum(v for ph, v in tx.items() if ph != "check") + commit_tx
    tx["commit (once)"] = commit_tx
    reqs = store_requests_per_rank(measured)
    service_reqs = sum(v for k, v in reqs.items() if k.split(": ", 1)[1].startswith("service")) + HEADER_GETS
    trainer_reqs_1part = sum(v for k, v in reqs.items() if "trainer" in k)
    return {
        "assume": assume, "tb": tb, "file_bytes": round(file_bytes), "parts_per_file": parts,
        "per_call_cpu_s_at_n": {k: round(v, 5) for k, v in per_rank.items()} | {"commit_total": round(f["commit"], 4)},
        "service_cpu_s_per_checkpoint": {"peer": round(cpu_total, 2), "store": round(cpu_store_mode, 2)},
        "service_cpu_in_the_burst_s": {k: round(v, 2) for k, v in burst_cpu.items()},
        "hand_overs_through_threads_s": round(hand_over_threads, 2),
        "catalog_rows_per_checkpoint": rows,
        "catalog_transactions_per_checkpoint": {"peer": round(tx_peer), "store": round(tx_store),
                                                "per_rank_by_phase": {k: round(v, 3) for k, v in tx.items()}},
        "store_requests_per_checkpoint": {
            "service": round(n * service_reqs),
            "trainers_peer": round(n * (trainer_reqs_1part + parts - 1)),   # one PUT a part, one GET (read-back)
            "trainers_store": round(n * parts),
            "measured_per_rank_one_part_file": reqs, "header_gets_per_file_from_the_code": HEADER_GETS},
        "table": table,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="16,64,256")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tb", type=float, default=1.0)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds the idle service is measured first")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--model-only", action="store_true", help="recompute the model from --out's measurements")
    a = ap.parse_args()
    if a.model_only:
        out = json.loads(a.out.read_text())
    else:
        out = {"machine": machine(), "measured": measure([int(x) for x in a.ranks.split(",")], a.reps, a.idle)}
    out["per_call"] = per_call(out["measured"])
    out["model"] = model(out["measured"], a.tb)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out["model"][k] for k in ("per_call_cpu_s_at_n", "service_cpu_s_per_checkpoint",
                                                   "catalog_rows_per_checkpoint", "store_requests_per_checkpoint",
                                                   "table")}, indent=2))


if __name__ == "__main__":
    main()
