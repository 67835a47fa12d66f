"""bench.stream at a tiny size, so that it never rots: the streamed restore, the bare gRPC
stream of the same stored files and the same from memory, every rep of each in the JSON.
The numbers are not checked (python -m bench.stream). Its `ranks` part is bench.run's
RankProcs, which bench.run's smoke run drives."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a service, a pipe server and torch: ~10 s quiet, 52 s at load 20
def test_stream_restore_smoke_runs_every_case(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.stream", "restore", "--size", "4M", "--reps", "3",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "stream-restore-4MiB.json").read_text())["restore"]
    assert doc["files"] >= 1 and doc["stored_bytes"] >= doc["bytes"] > 0
    assert set(doc["seconds"]) == {"lastgood_restore_stream", "grpc_file", "grpc_memory"}
    for name, seconds in doc["seconds"].items():
        assert len(seconds) == 3 and all(s > 0 for s in seconds), name
    assert len(doc["ratio_vs_grpc_file_by_rep"]) == 3 and doc["ratio_vs_grpc_file"] > 0
