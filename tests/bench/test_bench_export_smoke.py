"""bench.export at a tiny size, so that it never rots: every case runs against a real
service and the JSON holds every figure (the numbers are not checked: `python -m
bench.export` is the benchmark, not a timed test)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench.export import CASES

ROOT = Path(__file__).resolve().parents[2]


def test_bench_export_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.export", "--sizes", "8MiB", "--reps", "3",
                           "--out", str(tmp_path), "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (block,) = json.loads((tmp_path / "export.json").read_text())["sizes"]
    assert block["state_bytes"] > block["weights_bytes"] >= block["largest_tensor_bytes"] > 0
    for case in CASES:
        fig = block["figures"][case]
        assert len(fig["seconds"]) == 3 and all(s > 0 for s in fig["seconds"]) and fig["peak_rss_mib"] > 0
    for name, value in block["ratios"].items():
        assert math.isfinite(value) and value > 0, name
    assert set(block["ratios"]) == {f"{c}_over_{b}" for c in ("export", "export_bf16") for b in ("read", "download")}
