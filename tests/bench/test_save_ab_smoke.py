"""bench.save_ab at a tiny size, so that it never rots: every variant saves through a real
service (followed, written whole, without early writeback, split) and the JSON holds each
one's figures and its ratios to DCP. The numbers are not checked (python -m bench.save_ab)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_save_ab_smoke_runs_every_variant(tmp_path):
    variants = ["dcp", "followed", "whole", "no-writeback", "followed-2-files"]
    proc = subprocess.run([sys.executable, "-m", "bench.save_ab", "--size", "4M", "--reps", "3", "--keep-cache",
                           "--variants", ",".join(variants), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(next(tmp_path.glob("save_ab-*.json")).read_text())
    assert doc["follow_offered"] is True and set(doc["variants"]) == set(variants)
    for name, v in doc["variants"].items():
        assert len(v["seconds"]) == 3 and all(s > 0 for s in v["seconds"]), name
        if name != "dcp":
            assert len(v["vs_dcp_reps"]) == 3 and v["vs_dcp"] > 0, name
