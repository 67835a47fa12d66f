"""bench.cold_restore at a tiny size, so that it never rots: a restore past the page cache,
the same through it, and DCP's load, and the JSON holds every case's figures. The numbers
are not checked (python -m bench.cold_restore)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_cold_restore_smoke_runs_every_case(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.cold_restore", "--size", "8M", "--reps", "2", "--keep-cache",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "cold_restore-8MiB.json").read_text())
    assert doc["cold"] is False and doc["file_system"]
    assert set(doc["cases"]) == {"past the page cache", "through the page cache", "dcp load"}
    for name, case in doc["cases"].items():
        assert len(case["seconds"]) == 2 and all(s > 0 for s in case["seconds"]), name
        if name != "past the page cache":
            assert len(case["past_cache_speedup_reps"]) == 2 and case["past_cache_speedup"] > 0, name
        if name != "dcp load":  # all of it cached (--keep-cache): nothing read past the page cache
            assert case["o_direct_bytes_reps"] == [0, 0], name


def test_cold_restore_refuses_a_directory_in_memory(tmp_path):
    """On tmpfs nothing is ever cold: the figures would compare two page-cache reads, so it
    refuses rather than write them."""
    from bench.cold_restore import fs_type

    shm = Path("/dev/shm")
    if not shm.is_dir() or fs_type(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    proc = subprocess.run([sys.executable, "-m", "bench.cold_restore", "--size", "8M", "--reps", "1", "--dir", str(shm),
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "tmpfs" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not list(tmp_path.iterdir()) and not list(shm.glob("lastgood-cold-restore-*"))
