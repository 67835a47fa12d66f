"""The memory tier against the durable tier alone, DCP on the local disk and the link, in one run.

    python -m bench.memory_tier                       # 256 MiB, 5 reps; writes bench/results/memory_tier.json
    python -m bench.memory_tier --size 8M --reps 2 --out /tmp/x   # tests/bench/test_memory_tier_smoke.py

Two nodes as network namespaces on one bridge (tests/netns.py, as the node-failure tests use),
each with its own `lastgood agent` on its veth address; the service on the bridge. One rank
process in node A (bench/memory_tier_rank.py) saves and restores a GPT-style state
(bench.common.build_state) through the Checkpointer, rep by rep in a rotating order:

  copy                  the plain CPU copy of the state into a touched buffer (the snapshot floor)
  durable / memory      save(): the stall (until it returns) and the commit (until wait() returns)
  dcp_save              DCP's FileSystemWriter into a local directory, fsync'd (it blocks)
  restore_memory_own    Checkpointer.restore of the memory checkpoint, from node A's own agent
  restore_memory_partner the same from node B's agent, over the veth
  restore_durable       Checkpointer.restore of the durable checkpoint from the store, through the
                        service's spool (the same host's files: as a rank on the service's host)
  restore_durable_streamed the same streamed over the veth (LASTGOOD_USE_SPOOL=0: as a rank on
                        another host, the store's case in a cluster)
  restore_dcp_local     DCP's load from the local directory (warm in the page cache)
  read_own / read_partner the memory checkpoint's files read raw from each agent, verified
  link                  a plain TCP stream of the same bytes from node A to node B (the veth)
  replication           node A's agent to node B's: bytes sent / time in acknowledged sends

Ratios (medians; per rep where the cases pair up): the memory save's stall to the copy (goal
<= 1.5x), the partner read to the link (goal >= 0.8x), the durable restore to the memory
restore from the partner (goal >= 5x; streamed, the cluster's case, and spooled), replication to the link; memory held per node against
the formula of docs/memory-tier.md (the segments held and the pool of recycled ones); and the work lost per failure at the issue's MTBF of 7.9 h
(1,024 GPUs), each tier at the shortest interval it sustains here: Daly's optimum on its stall
(lastgood.common.interval.daly), never shorter than one save to commit; lost = half an interval
and its stall (expected_loss), plus its restore.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from bench.common import ROOT, http_json, machine, parse_size, size_label, write_results
from lastgood.common.interval import daly, expected_loss
from lastgood.remote import config
from lastgood.wire import tiers

MTBF_S = 7.9 * 3600  # the job MTBF the issue cites at 1,024 GPUs
SINK_PORT = 7400
KEEP, REPLICAS = tiers.DEFAULT_MEMORY_KEEP, tiers.DEFAULT_REPLICAS


def _rank(node, fab, *args: str, timeout: float) -> str:
    env = {config.ENV_URL: fab.service.url, config.ENV_TOKEN: fab.token, "OMP_NUM_THREADS": "1"}
    import subprocess

    proc = node.popen([sys.executable, "-m", "bench.memory_tier_rank", *args], env=env, cwd=ROOT,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"bench.memory_tier_rank {args[0]} in {node.label}: rc {proc.returncode}\n{err[-3000:]}")
    return out.strip().splitlines()[-1]


def link(a, b, fab, nbytes: int) -> dict:
    """A plain TCP stream A -> B of `nbytes` over the veth: what the link carries for Python
    sockets moving 1 MiB at a time (the agents' own unit)."""
    import subprocess

    sink = b.popen([sys.executable, "-m", "bench.memory_tier_rank", "sink", str(SINK_PORT)], cwd=ROOT,
                   stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    got = json.loads(_rank(a, fab, "send", f"{b.ip}:{SINK_PORT}", str(nbytes), timeout=300))
    sink.wait(60)
    return got


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(raw: dict, links: list[dict], status: dict, size: int) -> dict:
    t = raw["times"]
    med = {k: _median(v) for k, v in t.items() if k != "read_bytes"}
    nbytes = t["read_bytes"][0]
    gbps = lambda b, s: b / s / 1e9  # noqa: E731
    link_gbps = _median([gbps(x["bytes"], x["seconds"]) for x in links])
    a, b = status["a"], status["b"]
    repl_gbps = gbps(a["replicated_bytes"], a["replication_seconds"]) if a["replication_seconds"] else None

    def lost(stall: float, commit: float, restore: float) -> dict:
        interval = max(daly(stall, MTBF_S), commit)
        return {"interval_s": interval, "lost_s": expected_loss(interval, stall) + restore, "restore_s": restore}

    lost_memory = lost(med["memory_stall"], med["memory_commit"], med["restore_memory_partner"])
    lost_durable = lost(med["durable_stall"], med["durable_commit"], med["restore_durable_streamed"])
    lost_dcp = lost(med["dcp_save"], med["dcp_save"], med["restore_dcp_local"])
    state = raw["state_bytes"]
    return {
        "seconds": med,
        "gbps": {"link": link_gbps, "read_own": gbps(nbytes, med["read_own"]),
                 "read_partner": gbps(nbytes, med["read_partner"]), "replication": repl_gbps},
        "ratios": {
            "memory_stall_vs_copy": med["memory_stall"] / med["copy"],
            "memory_stall_vs_copy_reps": [s / c for s, c in zip(t["memory_stall"], t["copy"])],
            "durable_stall_vs_copy": med["durable_stall"] / med["copy"],
            "partner_read_vs_link": gbps(nbytes, med["read_partner"]) / link_gbps,
            "replication_vs_link": repl_gbps / link_gbps if repl_gbps else None,
            "durable_restore_vs_memory_partner": med["restore_durable_streamed"] / med["restore_memory_partner"],
            "durable_restore_vs_memory_partner_reps": [d / m for d, m in zip(t["restore_durable_streamed"],
                                                                             t["restore_memory_partner"])],
            "spooled_durable_restore_vs_memory_partner": med["restore_durable"] / med["restore_memory_partner"],
            "durable_restore_vs_memory_own": med["restore_durable"] / med["restore_memory_own"],
            "dcp_local_restore_vs_memory_partner": med["restore_dcp_local"] / med["restore_memory_partner"],
            "lost_durable_vs_memory": lost_durable["lost_s"] / lost_memory["lost_s"],
            "lost_dcp_local_vs_memory": lost_dcp["lost_s"] / lost_memory["lost_s"],
        },
        "goals": {"memory_stall_vs_copy": "<= 1.5", "partner_read_vs_link": ">= 0.8",
                  "durable_restore_vs_memory_partner": ">= 5"},
        "memory_per_node": {
            "held_bytes": {"node-a": a["held_bytes"], "node-b": b["held_bytes"]},
            "held_checkpoints": {"node-a": len(a["segments"]), "node-b": len(b["segments"])},
            # here node A holds its rank's copies and node B the replicas: one copy a node of each
            # checkpoint kept, (keep + 1) x state; with ranks on every node, (1 + replicas) of them
            "formula_bytes_here": (KEEP + 1) * state,
            "formula": "(memory:latest + 1) x (1 + replicas) x state bytes of the node's ranks, "
                       "each node's ranks' copies plus its partners' replicas",
            # what the node's tmpfs holds: the segments and the pool the next one is written into
            "held_and_pooled_vs_formula": max(a["held_bytes"] + a["pooled_bytes"],
                                              b["held_bytes"] + b["pooled_bytes"]) / ((KEEP + 1) * state),
            "pooled_bytes": {"node-a": a["pooled_bytes"], "node-b": b["pooled_bytes"]},
        },
        "lost_per_failure": {"mtbf_s": MTBF_S, "memory": lost_memory, "durable_alone": lost_durable,
                             "dcp_local": lost_dcp},
        "state_bytes": state, "size": size_label(size), "restore_reads": raw["reads"],
        "memory_stats": raw["memory_stats"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256M", help="the state's size (default 256M)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    size = parse_size(args.size)

    from tests.netns import Fabric, netns_unavailable

    why = netns_unavailable()
    if why:
        raise SystemExit(f"bench.memory_tier needs network namespaces: {why}")
    with tempfile.TemporaryDirectory(prefix="lastgood-bench-memory-") as work:
        fab = Fabric(Path(work) / "svc", {"LASTGOOD_LOG_LEVEL": "WARNING"}).open()
        try:
            budget = str(8 * size + (64 << 20))
            a = fab.node("node-a").start_agent("--memory-budget", budget)
            b = fab.node("node-b").start_agent("--memory-budget", budget)
            links = [link(a, b, fab, max(size, 64 << 20)) for _ in range(3)]
            arg = {"size": size, "reps": args.reps, "own": a.agent_address, "partner": b.agent_address,
                   "dcp": str(Path(work) / "dcp"), "run": f"bench-memory-{uuid.uuid4().hex[:8]}"}
            t0 = time.monotonic()
            raw = json.loads(_rank(a, fab, "measure", json.dumps(arg), timeout=3600))
            status = {n.label[-1]: http_json(f"http://{n.agent_address}{tiers.AGENT_STATUS_PATH}") for n in (a, b)}
            doc = {"bench": "memory_tier", "machine": machine(), "reps": args.reps,
                   "wall_s": time.monotonic() - t0, "links": links,
                   **summarize(raw, links, status, size), "raw": raw["times"]}
        finally:
            fab.close()
    write_results(args.out, "memory_tier", doc)
    r, g = doc["ratios"], doc["gbps"]
    print(f"state {doc['size']} ({doc['state_bytes']} B), {args.reps} reps")
    print(f"stall: memory save {doc['seconds']['memory_stall'] * 1e3:.1f} ms = {r['memory_stall_vs_copy']:.2f}x "
          f"the plain copy (goal <= 1.5x); durable {r['durable_stall_vs_copy']:.2f}x")
    print(f"link {g['link']:.2f} GB/s; read from partner {g['read_partner']:.2f} GB/s = {r['partner_read_vs_link']:.2f}x "
          f"(goal >= 0.8x); replication {g['replication'] or 0:.2f} GB/s = {r['replication_vs_link'] or 0:.2f}x")
    print(f"restore: durable streamed {doc['seconds']['restore_durable_streamed']:.3f} s (spooled "
          f"{doc['seconds']['restore_durable']:.3f} s), memory (partner) "
          f"{doc['seconds']['restore_memory_partner']:.3f} s = {r['durable_restore_vs_memory_partner']:.2f}x faster "
          f"(goal >= 5x); own {doc['seconds']['restore_memory_own']:.3f} s; DCP local "
          f"{doc['seconds']['restore_dcp_local']:.3f} s")
    lost = doc["lost_per_failure"]
    print(f"lost per failure at MTBF 7.9 h: memory {lost['memory']['lost_s']:.1f} s, durable alone "
          f"{lost['durable_alone']['lost_s']:.1f} s, DCP local {lost['dcp_local']['lost_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
