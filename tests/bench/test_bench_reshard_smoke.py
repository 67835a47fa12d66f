"""bench.reshard at a tiny size, so that it never rots: a 4 -> 3 restore by ranges and the
3 -> 3 restore beside it, against a real service, and every figure in the JSON (the times
are not checked: `python -m bench.reshard` is the benchmark, not a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_reshard_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.reshard", "--smoke", "--layers", "2", "--dim", "64",
                           "--out", str(tmp_path), "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "smoke.json").read_text())
    resharded, same = result["cases"]
    assert (resharded["before"], resharded["after"], same["before"], same["after"]) == (4, 3, 3, 3)
    whole = resharded["checkpoint_bytes"]
    for r in resharded["per_rank"]:
        assert r["requests"] > 0 and 0 < r["bytes_read"] < whole and r["new_shard_bytes"] > 0
        assert r["sharded_ratio"] >= 1 and r["restore_s"] > 0
    assert resharded["time_vs_same_world"] > 0
    assert [b["block_bytes"] for b in result["projection"]["by_block"]]
