"""bench.dedup at a tiny size on 2 ranks, so that it never rots: the three cases against a
real service and every figure in the JSON (the times are not checked: `python -m
bench.dedup` is the benchmark, not a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dedup_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.dedup", "--smoke", "--ranks", "2", "--out", str(tmp_path),
                           "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "smoke-dedup.json").read_text())
    dedup, full, dcp = result["cases"]
    assert all(len(c["uploaded_bytes_per_rank"]) == 2 and c["state_bytes"] > 0 for c in result["cases"])
    assert full["stored_vs_state"] > 1.9 and full["min_uploaded_vs_state"] > 0.95  # every rank in full
    # one copy, plus each rank's own bits (RNG, header), which a tiny model makes visible
    assert dedup["stored_vs_state"] < 1.3 and dedup["max_uploaded_vs_state"] < 0.7
    assert dcp["stored_vs_state"] < 1.3
    assert result["same_run_ratios"]["stored_dedup_vs_no_dedup"] < 0.7
