"""bench.cluster at two tiny rank counts, so that it never rots: every phase of a direct-S3
save in `peer` mode runs against a real service and moto, the store requests are counted
by who made them, and the model's table comes out (its figures are not checked here:
`python -m bench.cluster` is the benchmark, not a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cluster_smoke(tmp_path):
    out = tmp_path / "cluster.json"
    proc = subprocess.run([sys.executable, "-m", "bench.cluster", "--ranks", "2,4", "--reps", "1", "--idle", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    for run in d["measured"]["runs"]:
        n, ph = run["ranks"], run["phases"]
        assert [ph[k]["calls"] for k in ("begin", "grant", "hand_over", "vote", "check", "check_and_commit",
                                         "outcome")] == [n, n, n, n, n - 1, 1, n]
        assert ph["grant"]["store_requests"] == {"service POST uploads": n, "trainer PUT part": n}  # one part each
        read_back = ph["check"]["store_requests"].get("trainer GET object", 0) \
            + ph["check_and_commit"]["store_requests"].get("trainer GET object", 0)
        assert read_back == n  # every file read back once, through a presigned GET
        assert run["catalog_rows"]["shards"] == run["catalog_rows"]["votes"] == n
    m = d["model"]
    assert [row["bandwidth_gb_s"] for row in m["table"]] == [10, 50, 200]
    for row in m["table"]:  # peer mode reads every byte back: never sooner than store mode
        assert row["peer"]["last_upload_to_committed_s"] >= row["store"]["last_upload_to_committed_s"] \
            + row["peer"]["of_it_read_back_s"] - 1e-6
    assert m["catalog_rows_per_checkpoint"]["shards"] == 1024
