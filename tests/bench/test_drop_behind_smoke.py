"""bench.drop_behind at a tiny size, so that it never rots: DCP and a save per drop-behind
limit, each through a service of its own, each followed by a restore, and the JSON holds
every case's figures. The numbers are not checked (python -m bench.drop_behind)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_drop_behind_smoke_runs_every_case(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.drop_behind", "--size", "8M", "--reps", "2", "--limits=-1,0",
                           "--keep-cache", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "drop_behind-8MiB.json").read_text())
    assert set(doc["cases"]) == {"dcp", "spool_cache_bytes=-1", "spool_cache_bytes=0"}
    for name, case in doc["cases"].items():
        assert len(case["seconds"]) == 2 and all(s > 0 for s in case["seconds"]), name
        if name != "dcp":
            assert len(case["restore_after_s"]) == 2 and case["vs_dcp"] > 0, name
