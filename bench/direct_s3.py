"""Service CPU per GiB committed: streamed (gRPC), spooled (same host) and direct to S3,
in one run against LocalStack's S3 (tests/localstack.py; `make .venv-localstack/.installed`).

    .venv/bin/python -m bench.direct_s3 [--mib 128] [--reps 2]

Each mode saves a one-tensor state of --mib MiB --reps times through a Checkpointer against
a service of its own on the same bucket server; the figure is the service process's CPU
seconds (user + system, /proc/<pid>/stat) spent from before the save to its commit, per
GiB committed, raw and net of what the idle service burns over the same wall time (its
reaper, sweeps and notifier; measured for 10 s before the saves). The ratios are same-run ratios; results go to bench/results/direct_s3.json.
What direct still costs the service: the grant, ListParts, completion, a HEAD, a ranged
read of the safetensors header and the commit (docs/direct-s3.md).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import lastgood
from bench.common import Service, machine
from tests.localstack import running

MiB = 1024 * 1024
IDLE_S = 10.0
MODES = {"stream": {"LASTGOOD_SPOOL": "false"}, "spool": {}, "direct": {"LASTGOOD_DIRECT_S3": "true", "LASTGOOD_VERIFICATION": "store"}}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "direct_s3.json")
    a = ap.parse_args()
    model = torch.nn.Linear(a.mib * MiB // 4 // 1024, 1024, bias=False)  # --mib MiB of fp32 weights
    out: dict = {"mib": a.mib, "reps": a.reps, "machine": machine(), "modes": {}}
    with tempfile.TemporaryDirectory(prefix="lastgood-bench-direct-") as tmp:
        home = Path(tmp)
        (home / "ls").mkdir()
        with running(home / "ls") as s3:
            for mode, env in MODES.items():
                bucket = s3.make_bucket(mode)
                svc = Service(home / mode, {**s3.env(bucket), **env, "LASTGOOD_DIRECT_S3_PART_SIZE": str(16 * MiB)})
                svc.start()
                try:
                    c0 = cpu_seconds(svc.pid)
                    time.sleep(IDLE_S)  # what the service burns doing nothing (reaper, sweeps, notifier)
                    idle_rate = (cpu_seconds(svc.pid) - c0) / IDLE_S
                    cpus, walls = [], []
                    with lastgood.Checkpointer(svc.url, run=f"bench-{mode}") as ckpt:
                        for step in range(a.reps):
                            c0, t0 = cpu_seconds(svc.pid), time.perf_counter()
                            ckpt.save(step, lastgood.TrainState(model=model))
                            ckpt.wait()
                            walls.append(time.perf_counter() - t0)
                            cpus.append(cpu_seconds(svc.pid) - c0)
                    gib = a.mib / 1024
                    out["modes"][mode] = {"service_cpu_s_per_gib": [round(c / gib, 3) for c in cpus],
                                          "net_of_idle_cpu_s_per_gib": [round((c - idle_rate * w) / gib, 3)
                                                                        for c, w in zip(cpus, walls)],
                                          "idle_cpu_s_per_s": round(idle_rate, 4),
                                          "wall_s": [round(w, 2) for w in walls]}
                    print(mode, out["modes"][mode], flush=True)
                finally:
                    svc.stop()
                    s3.empty_bucket(bucket)
    med = {m: sorted(v["service_cpu_s_per_gib"])[len(v["service_cpu_s_per_gib"]) // 2] for m, v in out["modes"].items()}
    net = {m: sorted(v["net_of_idle_cpu_s_per_gib"])[len(v["net_of_idle_cpu_s_per_gib"]) // 2]
           for m, v in out["modes"].items()}
    out["direct_vs_stream_net_cpu"] = round(net["direct"] / net["stream"], 4) if net["stream"] > 0 else None
    out["direct_vs_stream_cpu"] = round(med["direct"] / med["stream"], 4) if med["stream"] else None
    out["direct_vs_spool_cpu"] = round(med["direct"] / med["spool"], 4) if med["spool"] else None
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
