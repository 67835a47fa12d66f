"""bench.pagecache at a tiny size, so that it never rots: every case writes and fsyncs the
bytes, and the JSON holds each one's times and its rep-by-rep ratio to the plain write. The
numbers are not checked (python -m bench.pagecache)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pagecache_smoke_runs_every_case(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.pagecache", "--size", "48M", "--reps", "2", "--late", "0.1",
                           "--keep-cache", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "pagecache-48MiB.json").read_text())
    assert doc["bytes"] == 48 << 20 and set(doc["cases"]) == {"plain", "drop-behind", "plain-late"}
    for name, case in doc["cases"].items():
        assert len(case["seconds"]) == 2 and all(s > 0 for s in case["seconds"]), name
        assert len(case["vs_plain_reps"]) == 2 and case["gib_per_s"] > 0, name
