"""The memory tier's scale model: memory per node, replication traffic and lost work per failure.

    python -m bench.memory_scale            # prints the table, writes bench/results/memory_scale.json

A model, not a measurement: every input is stated below, with where it comes from, and
docs/memory-tier.md's table is this script's output (tests/unit/test_memory_scale_doc.py holds
the two together). The formulas are the design's:

  state per node     = state bytes / nodes (fully sharded: FSDP2 / ZeRO-3)
  memory per node    = (keep + 1) x (1 + replicas) x state per node
                       (`keep` committed memory checkpoints plus the one being written, each
                       on its own node and on `replicas` partners; docs/memory-tier.md)
  stall per save     = state per GPU / D2H bandwidth (save() returns once the snapshot is in
                       host memory; replication and the store run behind it)
  memory interval    = Daly's optimum (lastgood.common.interval.daly, the rule of the service's auto interval), C the stall, M the
                       job's MTBF, never shorter than one replication of the node's state
  durable interval   = an input (DURABLE_INTERVAL_S): what the store's cost and bandwidth allow
  lost per failure   = interval / 2 (work since the last checkpoint, on average) + restore time
  restore time       = state per node / the path's bandwidth (own node's memory: the H2D copy;
                       a partner: the replication link; the store: its read bandwidth per node)

Lost work per failure is the figure the memory tier exists to cut.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lastgood.common.interval import daly

GB = 1e9

# Inputs, each with its source. Bytes per parameter: fp32 weights + AdamW's two fp32 moments
# (12; bf16 training keeps an fp32 master copy: the checkpoint holds it, not the bf16 view).
BYTES_PER_PARAM = 12
GPUS_PER_NODE = 8
D2H_GBPS = 50.0           # pinned device-to-host per GPU, H100/H200 class (public: ~55 GB/s)
H2D_GBPS = 50.0           # the same link back
LINK_GBPS = 50.0          # a node's network, 400 Gb/s
REPLICATION_SHARE = 0.10  # the share of the link the agent's token bucket lets replication take
STORE_GBPS_PER_NODE = 2.0  # what each node reads from a shared parallel file system / object store
DURABLE_INTERVAL_S = 1800  # the durable tier's interval, an input: set by the store's cost and its share
                           # among jobs, not by the trainer's stall (Orbax's defaults: persistent
                           # every 1,000 steps, local every 10)
REPLICAS = 1
KEEP = 1

# The scales of the issue: Meta's projected job MTBF (7.9 h at 1,024 GPUs, 1.8 h at 16,384) and
# Llama 3's model sizes at those scales (70B, 405B).
SCALES = (
    {"gpus": 1024, "params": 70e9, "mtbf_h": 7.9},
    {"gpus": 16384, "params": 405e9, "mtbf_h": 1.8},
)


def model(gpus: int, params: float, mtbf_h: float) -> dict:
    nodes = gpus // GPUS_PER_NODE
    state = params * BYTES_PER_PARAM
    per_node, per_gpu = state / nodes, state / gpus
    mtbf = mtbf_h * 3600
    stall = per_gpu / (D2H_GBPS * GB)
    repl_bps = LINK_GBPS * GB * REPLICATION_SHARE
    replicate_s = REPLICAS * per_node / repl_bps
    memory_interval = max(daly(stall, mtbf), replicate_s)
    durable_interval = DURABLE_INTERVAL_S
    restore = {"own node": per_node / (H2D_GBPS * GB * GPUS_PER_NODE),
               "partner": per_node / (LINK_GBPS * GB),
               "store": per_node / (STORE_GBPS_PER_NODE * GB)}
    # a lost node restores from a partner; the other nodes from their own memory: the job waits
    # for the slowest, the partner path
    lost_memory = memory_interval / 2 + restore["partner"]
    lost_durable = durable_interval / 2 + restore["store"]
    per_day = 24 / mtbf_h  # failures a day
    return {
        "gpus": gpus, "nodes": nodes, "params": params, "mtbf_h": mtbf_h,
        "state_gb": state / GB, "state_per_node_gb": per_node / GB,
        "memory_per_node_gb": (KEEP + 1) * (1 + REPLICAS) * per_node / GB,
        "stall_s": stall,
        "memory_interval_s": memory_interval,
        "replication_gb_per_s_per_node": REPLICAS * per_node / memory_interval / GB,
        "durable_interval_s": durable_interval,
        "restore_s": restore,
        "lost_per_failure_s": {"memory tier": lost_memory, "durable tier alone": lost_durable},
        "lost_ratio": lost_durable / lost_memory,
        "failures_per_day": per_day,
        "lost_gpu_hours_per_day": {"memory tier": lost_memory * gpus / 3600 * per_day,
                                   "durable tier alone": lost_durable * gpus / 3600 * per_day},
    }


def inputs() -> dict:
    return {"bytes_per_param": BYTES_PER_PARAM, "gpus_per_node": GPUS_PER_NODE, "d2h_gbps": D2H_GBPS,
            "h2d_gbps": H2D_GBPS, "link_gbps": LINK_GBPS, "replication_share": REPLICATION_SHARE,
            "store_gbps_per_node": STORE_GBPS_PER_NODE, "durable_interval_s": DURABLE_INTERVAL_S, "replicas": REPLICAS,
            "keep": KEEP}


def table(rows: list[dict]) -> str:
    """The Markdown table docs/memory-tier.md quotes (one column per scale)."""
    head = "| | " + " | ".join(f"{r['gpus']:,} GPUs ({r['params'] / 1e9:.0f}B, MTBF {r['mtbf_h']} h)"
                                 for r in rows) + " |"
    lines = [head, "|---|" + "---|" * len(rows)]

    def row(label, fmt):
        lines.append(f"| {label} | " + " | ".join(fmt(r) for r in rows) + " |")

    row("state (all ranks) / per node", lambda r: f"{r['state_gb']:,.0f} GB / {r['state_per_node_gb']:.1f} GB")
    row("host memory per node for the tier", lambda r: f"{r['memory_per_node_gb']:.1f} GB")
    row("trainer stall per save", lambda r: f"{r['stall_s'] * 1000:.0f} ms")
    row("memory interval / durable interval", lambda r: f"{r['memory_interval_s']:.0f} s / "
        f"{r['durable_interval_s'] / 60:.0f} min")
    row("replication per node (average)", lambda r: f"{r['replication_gb_per_s_per_node']:.2f} GB/s")
    row("restore: own memory / partner / store", lambda r: " / ".join(
        f"{r['restore_s'][k]:.2f} s" for k in ("own node", "partner", "store")))
    row("lost per failure: memory tier / durable alone", lambda r: f"{r['lost_per_failure_s']['memory tier']:.0f} s"
        f" / {r['lost_per_failure_s']['durable tier alone'] / 60:.1f} min ({r['lost_ratio']:.0f}x)")
    row("GPU-hours lost a day: memory tier / durable alone", lambda r: (
        f"{r['lost_gpu_hours_per_day']['memory tier']:.0f} / {r['lost_gpu_hours_per_day']['durable tier alone']:.0f}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    rows = [model(**s) for s in SCALES]
    print(table(rows))
    out = Path(args.out) / "memory_scale.json"
    out.write_text(json.dumps({"model": True, "inputs": inputs(), "scales": rows}, indent=2) + "\n")
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
