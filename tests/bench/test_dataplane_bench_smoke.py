"""bench/dataplane.py at tiny sizes, so that it never rots (the numbers are not checked:
the real run is `python -m bench.dataplane`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dataplane_bench_smoke_has_every_figure(tmp_path):
    out = tmp_path / "dataplane.json"
    proc = subprocess.run([sys.executable, "-m", "bench.dataplane", "--size", "1M", "--ranks", "2", "--saves", "1",
                           "--reps", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["path"] for r in res["cpu_per_gib"]] == ["streamed", "spool", "direct-FS (service mode)",
                                                       "direct-FS (peer mode)"]
    assert all(r["service_cpu_s_per_gib"] >= 0 for r in res["cpu_per_gib"])
    many = res["many_ranks"]
    assert many["ranks"] == 2 and len(many["ratio_per_rep"]) == 1 and many["ratio_median"] > 0
