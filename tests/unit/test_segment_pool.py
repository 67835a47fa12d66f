"""The agent's segment pool (lastgood/agent/segments.py, "Recycling"): a freed checkpoint's
files are kept and a new segment that names its files takes them, so its bytes land in pages
already allocated (the same inode, overwritten in place and truncated); the pool counts against
the budget and is given up first, and it keeps at most the bytes freed last.
On a real tmpfs (/dev/shm) where there is one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from lastgood.agent.segments import POOL, BudgetExceeded, Segments
from lastgood.common.durable import open_for_overwrite, write_all

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
N = 1 << 20


@pytest.fixture
def root():
    with tempfile.TemporaryDirectory(prefix="lastgood-pool-", dir=SHM) as d:
        yield Path(d)


def _save(seg: Segments, cid: int, data: bytes, name: str = "rank00000.safetensors", files=True) -> Path:
    """What a rank does: reserve (naming its file, or not), write it in place, truncate, seal."""
    d = seg.reserve("run", cid, 0, len(data), [(name, len(data))] if files else None)
    with open_for_overwrite(d / name) as f:
        write_all(f.fileno(), data)
        f.truncate(len(data))
    seg.seal("run", cid, 0, [name])
    return d / name


def test_a_freed_segment_is_reused_in_place_by_the_next_one(root):
    seg = Segments(root)
    first = _save(seg, 1, b"a" * N)
    inode = os.stat(first).st_ino
    seg.free("run", 1)
    assert not first.exists() and seg.pooled_bytes() == N
    second = _save(seg, 2, b"b" * (N - 10))
    assert os.stat(second).st_ino == inode and seg.recycled == 1  # the same pages, overwritten
    assert second.read_bytes() == b"b" * (N - 10)  # truncated to its own size: nothing of the old left
    assert seg.pooled_bytes() == 0
    assert seg.digest("run", 2, 0, "rank00000.safetensors")[0] == N - 10


def test_control_a_reservation_that_names_no_files_gets_new_ones(root):
    seg = Segments(root)
    inode = os.stat(_save(seg, 1, b"a" * N)).st_ino
    seg.free("run", 1)
    second = _save(seg, 2, b"b" * N, files=False)
    assert os.stat(second).st_ino != inode and seg.recycled == 0 and seg.pooled_bytes() == N


def test_the_pool_counts_against_the_budget_and_goes_first(root):
    seg = Segments(root, budget=3 * N)
    _save(seg, 1, b"a" * N)
    _save(seg, 2, b"b" * N)
    seg.free("run", 1)
    assert seg.pooled_bytes() == N and seg.held_bytes() == N
    # 2 N more: the pool's file is unlinked for room; checkpoint 2 (the newest complete) stays
    seg.reserve("run", 3, 0, 2 * N)
    assert seg.pooled_bytes() == 0 and not any((root / POOL).iterdir())
    assert seg.digest("run", 2, 0, "rank00000.safetensors")[0] == N
    with pytest.raises(BudgetExceeded):
        seg.reserve("run", 4, 0, 3 * N)


@pytest.mark.parametrize("budget", [None, 100 * N])
def test_the_pool_keeps_the_bytes_freed_last(root, budget):
    seg = Segments(root, budget=budget)
    for cid in range(1, 5):
        _save(seg, cid, bytes([cid]) * N, files=False)
    for cid in range(1, 4):
        seg.free("run", cid)
    assert seg.pooled_bytes() == N and len(list((root / POOL).iterdir())) == 1


def test_a_new_agent_empties_what_an_earlier_one_left_in_the_pool(root):
    seg = Segments(root)
    _save(seg, 1, b"a" * N)
    seg.free("run", 1)
    assert any((root / POOL).iterdir())
    assert Segments(root).pooled_bytes() == 0 and not any((root / POOL).iterdir())


def test_a_budget_of_exactly_what_is_held_still_pools_the_freed_checkpoint(root):
    """The freed checkpoint's own bytes are not counted as held when its pool share is set."""
    seg = Segments(root, budget=2 * N)
    _save(seg, 1, b"a" * N)
    _save(seg, 2, b"b" * N)
    seg.free("run", 1)
    assert seg.pooled_bytes() == N


def test_a_file_open_for_reading_when_freed_is_not_recycled_under_its_reader(root):
    """A partner's copy or a ranged read in flight keeps the bytes it opened: the file is
    unlinked, not pooled, so the next checkpoint cannot overwrite it in place."""
    seg = Segments(root)
    _save(seg, 1, b"a" * N)
    with seg.open("run", 1, 0, "rank00000.safetensors") as reader:
        seg.free("run", 1)
        assert seg.pooled_bytes() == 0
        _save(seg, 2, b"c" * N)
        assert reader.read() == b"a" * N
    assert seg.recycled == 0


def test_a_recycled_file_is_cut_to_its_new_size_when_placed(root):
    """Before the writer writes a byte: a writer that dies leaves nothing beyond its reservation."""
    seg = Segments(root)
    _save(seg, 1, b"a" * N)
    seg.free("run", 1)
    d = seg.reserve("run", 2, 0, 10, [("rank00000.safetensors", 10)])
    assert (d / "rank00000.safetensors").stat().st_size == 10 and seg.recycled == 1
