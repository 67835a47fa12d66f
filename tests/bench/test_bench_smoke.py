"""The benchmark at tiny sizes, so that it never rots: every case runs against a real
service and the JSON holds every figure. The numbers themselves are not checked (the full
benchmark is `make bench`, not a timed test)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

from bench.run import PER_SIZE, RATIOS, TARGETS

ROOT = Path(__file__).resolve().parents[2]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_bench_smoke_produces_every_figure(tmp_path):
    out = tmp_path / "results"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "bench.run", "--smoke", "--quiet-check", "--out", str(out),
                           "--workdir", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "smoke-latest.json").read_text())
    assert doc["smoke"] is True and doc["machine"]["cpus"] >= 1

    assert doc["sizes"], "no state size was measured"
    for block in doc["sizes"]:
        assert block["bytes"] > 0
        for name in PER_SIZE:
            fig = block["figures"][name]
            assert len(fig["seconds"]) >= 3, (block["label"], name, "a figure is a median of >= 3 reps")
            assert all(_number(s) and s > 0 for s in fig["seconds"]), (block["label"], name, fig)
            assert _number(fig["median_s"]) and _number(fig["gib_per_s"]), (block["label"], name)
            assert _number(fig["spread"]) and fig["min_s"] <= fig["median_s"] <= fig["max_s"], (block["label"], name)
        for name in RATIOS:
            assert _number(block["ratios"][name]) and block["ratios"][name] > 0, (block["label"], name)
            assert len(block["ratio_reps"][name]) >= 3 and isinstance(block["noisy"][name], bool)
        rss = block["service_rss"]
        assert len(rss["peak_mib_reps"]) >= 3 and rss["peak_mib"] >= rss["baseline_mib"] > 0

        assert len(rss["spool_peak_mib_reps"]) >= 3 and _number(rss["spool_peak_mib"])
        # each restore case read its files through the page cache first: the warm-up pass and every rep
        warmed = block["restore_warmed"]
        assert set(warmed) == {"torch_load", "dcp_load", "lastgood_restore", "lastgood_restore_stream"}
        for key, runs in warmed.items():
            assert len(runs) == 1 + len(block["figures"][key]["seconds"]), key
            # its own files, and no more: the restored commit's alone (the whole blob folder,
            # read at first, held four commits: the bench's three Checkpointers' heads and more)
            assert all(w["files"] >= 1 and block["bytes"] * 0.9 <= w["bytes"] <= block["bytes"] * 1.1 + (1 << 20)
                       for w in runs), (key, runs)
            assert all(w["cached_after"] >= 0.9 for w in runs), (key, runs)  # and they stayed

    for key, spool in (("four_ranks", True), ("four_ranks_stream", False)):
        four = doc[key]
        assert four["ranks"] == 4 and four["spool"] is spool
        assert len(four["aggregate_s"]) >= 3 and len(four["raw_s"]) >= 3
        assert _number(four["ratio"]) and _number(four["aggregate_gib_per_s"]) and _number(four["raw_gib_per_s"])
        assert _number(four["service_rss_peak_mib"])

    scale = doc["scale"]
    assert len(scale["reps"]) >= 3 and _number(scale["last_vote_to_commit_s"])
    assert len(scale["waiting_votes"]["reps"]) >= 3 and _number(scale["waiting_votes"]["first_vote_to_commit_s"])

    cat = doc["catalog"]
    for key in ("list", "list_committed", "list_last_page"):
        assert len(cat[key]["p99_ms_reps"]) >= 3 and _number(cat[key]["p50_ms"]) and _number(cat[key]["p99_ms"])

    assert _number(doc["service_rss"]["peak_mib"])
    # one verdict per target (the per-size ones once per size), each with its number
    per_size = sum(1 for _n, path, *_ in TARGETS if "." not in path)
    assert len(doc["targets"]) == per_size * len(doc["sizes"]) + len(TARGETS) - per_size
    # a target whose figures spread too wide has no verdict ("too noisy to judge")
    assert all(_number(t["value"]) and (t["met"] is None if t["noisy"] else isinstance(t["met"], bool))
               for t in doc["targets"])
    quiet = doc["quiet_check"]  # the disk's own variance, measured first
    assert len(quiet["seconds"]) >= 3 and _number(quiet["spread"]) and isinstance(quiet["quiet"], bool)
    assert quiet["attempts"] and quiet["attempts"][-1]["spread"] == quiet["spread"]
    assert "(--quiet-check)" in doc["table_markdown"]
    assert doc["settle_s"]["cases"] > 0 and _number(doc["settle_s"]["total"])
    assert "| target |" in doc["table_markdown"] and "| target |" in proc.stdout
    print(f"bench smoke took {elapsed:.0f} s")


def test_quiet_wait_measures_again_until_quiet_or_out_of_time(tmp_path, monkeypatch):
    """--quiet-wait: a NOT QUIET disk is measured again after QUIET_PAUSE until the wait is spent,
    the bound unchanged and every attempt kept; a quiet first attempt starts the run at once."""
    from bench import run

    monkeypatch.setattr(run, "FRESH_CACHE", [False])
    monkeypatch.setattr(run, "QUIET_PAUSE", 0.2)
    monkeypatch.setattr(run, "QUIET", -1.0)  # no spread is this small: never quiet
    t0 = time.monotonic()
    never = run.wait_for_quiet(tmp_path, 1 << 20, 3, 1.5)
    assert never["quiet"] is False and 3 <= len(never["attempts"]) <= 8, len(never["attempts"])
    assert time.monotonic() - t0 < 10 and never["attempts"][-1]["seconds"] == never["seconds"]

    monkeypatch.setattr(run, "QUIET", 1e9)  # the control: any spread is quiet (if the load allows)
    monkeypatch.setattr(run.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    once = run.wait_for_quiet(tmp_path, 1 << 20, 3, 60)
    assert once["quiet"] is True and len(once["attempts"]) == 1


def test_every_rep_runs_the_cases_in_another_order_behind_other_neighbours():
    """What a case leaves behind (writeback, freed memory, a deleted file's discards) must
    not fall on the same case every rep. A rotation, the order before 2026-12-02, kept
    every case behind the same neighbour (lastgood sync behind DCP in every save rep)."""
    from bench.common import order_of

    for n in range(2, 9):
        cases = [f"case{k}" for k in range(n)]
        orders = [order_of(cases, i) for i in range(5)]
        assert all(sorted(o) == cases for o in orders), n  # each case once a rep
        firsts = [o[0] for o in orders]
        assert len(set(firsts)) == min(n, 5), (n, firsts)  # another case starts each rep
        if n < 3:
            continue  # two cases: each follows the other, or nothing
        for c in cases:
            before = [o[o.index(c) - 1] for o in orders if o.index(c) > 0]
            assert len(set(before)) > 1, (n, c, orders)  # never the same neighbour every time
            assert max(before.count(b) for b in before) <= 2, (n, c, orders)


def test_a_restore_case_reads_its_files_warm_whatever_the_cases_before_it_evicted(tmp_path):
    """bench.common.warm_files, run untimed before each restore case: a file the page
    cache has lost (lastgood's restore reads a cold piece with O_DIRECT, so it stayed cold
    for lastgood alone) is cached again, all of it, and what it read is reported."""
    import mmap
    import os

    import pytest

    from bench.cold_restore import IN_MEMORY, fs_type
    from bench.common import warm_files
    from lastgood.common import durable

    if fs_type(tmp_path) in IN_MEMORY:
        pytest.skip("a file in memory cannot leave the page cache")
    folder = tmp_path / "blobs" / "r0"
    folder.mkdir(parents=True)
    size = 8 << 20
    for name in ("a", "b"):
        with open(folder / name, "wb") as f:
            f.write(os.urandom(size))
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def cached(path) -> float:
        fd = os.open(path, os.O_RDONLY)
        try:
            pages = durable.cached_pieces(fd, 0, size, mmap.PAGESIZE)
        finally:
            os.close(fd)
        assert pages is not None, "mincore unavailable"
        return sum(pages) / len(pages)

    # the control: both files out of the page cache, as a case before could leave them
    if not (cached(folder / "a") < 0.5 and cached(folder / "b") < 0.5):
        pytest.skip("this file system keeps a file's pages after POSIX_FADV_DONTNEED")
    got = warm_files([tmp_path / "blobs"])
    assert got["files"] == 2 and got["bytes"] == 2 * size and got["seconds"] > 0
    assert got["cached_after"] >= 0.99 and min(cached(folder / "a"), cached(folder / "b")) >= 0.99
    empty = warm_files([])  # the gRPC ceiling reads no file
    assert empty["files"] == 0 and empty["bytes"] == 0 and empty["cached_after"] is None
