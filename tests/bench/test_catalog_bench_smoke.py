"""The catalog benchmark and the soak at tiny sizes, so that they never rot (the numbers
are not checked: the real runs are `python -m bench.catalog` and `make soak`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_catalog_bench_smoke_has_every_figure(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.catalog", "--backend", "sqlite", "--runs", "4",
                           "--checkpoints", "20", "--ranks", "2", "--backlog", "1", "--saves", "4", "--block", "2",
                           "--query-reps", "3", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "catalog.json").read_text())["sqlite"]
    assert res["gc"]["first full pass (catch-up of the backlog)"]["deleted"] == 20 - 3
    assert res["saves"]["saves_per_mode"] == 4 and res["saves"]["p99_ratio_on_off"] > 0
    assert set(res["queries"]) >= {"overview (100 runs)", "runs list (100 runs)", "lineage (a whole run)",
                                   "events by kind (the page)", "checkpoints by status"}


def test_catalog_bench_reuses_a_kept_seeded_catalog_for_the_queries_alone(tmp_path):
    """`--seeded DIR` seeds once and keeps it; a second run starts from a copy of it, and
    `--only-queries` times the page's queries without the GC passes and the saves."""
    def bench(*more):
        proc = subprocess.run([sys.executable, "-m", "bench.catalog", "--backend", "sqlite", "--runs", "3",
                               "--checkpoints", "10", "--ranks", "2", "--backlog", "1", "--query-reps", "2",
                               "--seeded", str(tmp_path / "kept"), "--only-queries", "--out", str(tmp_path), *more],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads((tmp_path / "catalog.json").read_text())["sqlite"]

    kept = tmp_path / "kept" / "3x10x2x1" / "sqlite"
    first = bench()
    seeded_at = (kept / "seeded.json").stat().st_mtime_ns, (kept / "catalog.db").stat().st_mtime_ns
    again = bench()
    assert ((kept / "seeded.json").stat().st_mtime_ns, (kept / "catalog.db").stat().st_mtime_ns) == seeded_at
    assert first["seed"]["kept_up"]["checkpoints"] == again["seed"]["kept_up"]["checkpoints"] == 20
    assert again["only_queries"] and "gc" not in again and "saves" not in again
    assert again["queries"]["lineage (a whole run)"]["p99_ms"] > 0


def test_soak_smoke_reports_every_window(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "0.4", "--windows", "2", "--writers", "1",
                           "--gc-interval", "5", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "soak.json").read_text())
    assert [w["window"] for w in res["windows"]] == [1, 2] and res["total_saves"] > 0
    assert all(w["rss_mib"] > 0 and w["open_files"] > 0 and w["threads"] > 0 for w in res["windows"])
