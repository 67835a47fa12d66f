"""bench.memory_tier at a tiny size, so that it never rots: two namespace nodes with their agents,
every case measured through a real service, and the JSON holds each figure and ratio. The
numbers are not checked (python -m bench.memory_tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.netns import require_netns

ROOT = Path(__file__).resolve().parents[2]


def test_memory_tier_bench_smoke_runs_every_case(tmp_path):
    require_netns()
    proc = subprocess.run([sys.executable, "-m", "bench.memory_tier", "--size", "4M", "--reps", "2", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "memory_tier.json").read_text())
    for case in ("copy", "memory_stall", "memory_commit", "durable_stall", "dcp_save", "restore_memory_own",
                 "restore_memory_partner", "restore_durable", "restore_durable_streamed", "restore_dcp_local",
                 "read_own", "read_partner"):
        assert len(doc["raw"][case]) == 2 and all(x > 0 for x in doc["raw"][case]), case
    assert doc["memory_stats"] == {"memory_committed": 2, "memory_given_up": 0}
    # the partner restore read the partner's copy, the own one the own agent's
    own, partner = doc["restore_reads"]["memory_own"], doc["restore_reads"]["memory_partner"]
    assert len({r["memory_copies"][0] for r in own}) == 1 and len({r["memory_copies"][0] for r in partner}) == 1
    assert own[0]["memory_copies"] != partner[0]["memory_copies"]
    assert all(v > 0 for v in doc["gbps"].values()) and doc["ratios"]["lost_durable_vs_memory"] > 0
