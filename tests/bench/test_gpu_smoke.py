"""bench.gpu's CPU fallback at a tiny size, so that the GPU bench never rots before a GPU runs
it: every case runs through a real service and the JSON holds each figure and its ratio to
its peer or limit. The numbers are not checked (make bench-gpu)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_cpu_fallback_writes_every_figure(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--size", "4M", "--reps", "2",
                           "--steps", "4", "--save-every", "2", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert doc["fallback"] is True and doc["device"] == "cpu" and doc["bytes"] > 0
    assert len(doc["snapshot"]["stall_vs_plain_reps"]) == 2 and doc["snapshot"]["stall_vs_plain"] > 0
    assert doc["d2h"]["gb_per_s"] > 0 and doc["d2h"]["vs_limit"] > 0
    assert len(doc["step_time"]["with_saves"]["seconds"]) == 4 and doc["step_time"]["mean_vs_without"] > 0
    assert doc["restore"]["plain_vs_restore"] > 0
