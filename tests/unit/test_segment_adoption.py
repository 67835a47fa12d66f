"""A restarted agent takes up what its predecessor left under the shm root (lastgood/agent/
segments.py, "Adoption"): every complete file hashed and held again, what was cut off (a copy
being received, `.part`; a reservation nothing was written to) removed, paths that are no
segment's left alone; `drop_all` (`lastgood agent --fresh`) removes it all instead. On a real
tmpfs (/dev/shm) where there is one."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from lastgood.agent.segments import Segments
from lastgood.wire.hashing import hash_bytes

SHM = Path("/dev/shm") if Path("/dev/shm").is_dir() else None


@pytest.fixture
def root():
    with tempfile.TemporaryDirectory(prefix="lastgood-adopt-", dir=SHM) as d:
        yield Path(d)


def _left_behind(root: Path) -> dict[str, bytes]:
    """What a killed agent leaves: two checkpoints' segments, a copy cut off, an empty
    reservation, and a folder that is no segment's."""
    seg = Segments(root)
    files = {"run-a/7/0/rank00000.safetensors": b"A" * 5000, "run-a/7/1/rank00001.safetensors": b"B" * 300,
             "run-b/9/0/rank00000.safetensors": b"C" * 77}
    for rel in files:
        run, cid, rank, _ = rel.split("/")
        seg.reserve(run, int(cid), int(rank), len(files[rel]))
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    (root / "run-b/9/0/rank00001.safetensors.part").write_bytes(b"cut off")
    seg.reserve("run-b", 10, 0, 100)  # reserved, nothing written
    (root / "not-a-segment").mkdir()
    (root / "not-a-segment" / "x").write_bytes(b"someone else's")
    return files


def test_a_new_agent_holds_and_lists_what_the_last_one_left(root):
    files = _left_behind(root)
    seg = Segments(root)  # the restarted agent
    assert seg.keys() == set()  # CONTROL: a new Segments holds nothing until it adopts
    adopted = seg.adopt()
    assert [(r, c, k) for r, c, k, _ in adopted] == [("run-a", 7, 0), ("run-a", 7, 1), ("run-b", 9, 0)]
    assert seg.keys() == {("run-a", 7), ("run-b", 9)}
    for run, cid, rank, got in adopted:
        rel = f"{run}/{cid}/{rank}/{got[0]['name']}"
        assert got == [{"name": got[0]["name"], "size": len(files[rel]), "xxh3_128": hash_bytes(files[rel])}]
        assert seg.digest(run, cid, rank, got[0]["name"]) == (len(files[rel]), hash_bytes(files[rel]))
    assert seg.held_bytes() == sum(map(len, files.values()))
    assert not (root / "run-b/9/0/rank00001.safetensors.part").exists()
    assert not (root / "run-b/10").exists()  # the empty reservation
    assert (root / "not-a-segment" / "x").read_bytes() == b"someone else's"  # not ours to judge
    with seg.open("run-a", 7, 0, "rank00000.safetensors") as f:  # served as a sealed file is
        assert f.read() == files["run-a/7/0/rank00000.safetensors"]


def test_drop_all_removes_what_the_last_agent_left_and_adopts_nothing(root):
    _left_behind(root)
    seg = Segments(root)
    seg.drop_all()
    assert seg.adopt() == [] and seg.keys() == set()
    assert sorted(p.name for p in root.iterdir()) == [".free"]  # every run's folder, the stray one too
