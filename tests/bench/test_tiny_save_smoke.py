"""bench.tiny_save for 3 reps, so that it never rots: every case (Checkpointer, lastgood's DCP
writer, stock DCP, the fsync floors, the Checkpointer with its files handed over and beating at
every phase change) runs through a real service and the JSON holds each one's
figures and its ratios to DCP. The numbers are not checked (make bench-tiny)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_save_smoke_runs_every_case(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.tiny_save", "--reps", "3", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "tiny_save.json").read_text())
    assert set(doc["cases"]) == {"checkpointer", "checkpointer_handed_over", "checkpointer_every_beat", "lastgood_dcp",
                                 "dcp", "floor", "floor_lastgood"} and doc["state_bytes"] > 0
    for name, c in doc["cases"].items():
        assert len(c["ms"]) == 3 and all(x > 0 for x in c["ms"]), name
        if name != "dcp":
            assert len(c["vs_dcp_reps"]) == 3 and c["vs_dcp"] > 0, name
        if name.startswith("checkpointer") or name == "lastgood_dcp":  # where the time goes: every save begins and votes
            assert c["calls"]["begin"]["per_save"] == 1 and c["calls"]["commit_rank"]["per_save"] == 1, name
    # a small state's files travel with its vote; handed over, they take a call of their own
    assert "put_followed" not in doc["cases"]["checkpointer"]["calls"], doc["cases"]["checkpointer"]["calls"]
    assert doc["cases"]["checkpointer_handed_over"]["calls"]["put_followed"]["per_save"] == 1
    assert len(doc["cases"]["checkpointer"]["vs_handed_over_reps"]) == 3
