"""The split rule of a rank's tensors into files (state/split.py): by size, whole tensors,
deterministic, the first file naming the tensors of the others."""

from __future__ import annotations

import json

import pytest
import torch

from lastgood.errors import CorruptCheckpoint, FormatError
from lastgood.wire.format import META_FILES, META_STATE, TensorSpec, parse_header, parse_state, sibling_shapes
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import FileEntry, Manifest
from lastgood.common import parallel
from lastgood.restore import files
from lastgood.wire import format
from lastgood.state import split

MiB = 1 << 20


def spec(name: str, mib: float, dtype: str = "F32") -> TensorSpec:
    return TensorSpec(name, dtype, (int(mib * MiB) // 4,))


def test_small_state_or_zero_setting_is_one_file():
    specs = [spec("a", 100), spec("b", 100)]
    assert split.plan(specs, 256 * MiB) == [specs]  # under two files' worth
    assert split.plan(specs, 0) == [specs]


def test_files_by_size_whole_tensors_balanced():
    specs = [spec(f"t{i}", 64) for i in range(16)]  # 1 GiB
    files = split.plan(specs, 256 * MiB)
    assert len(files) == 4
    assert sorted(s.name for f in files for s in f) == sorted(s.name for s in specs)  # each tensor once
    assert [sum(s.nbytes for s in f) for f in files] == [256 * MiB] * 4
    for f in files:  # each file keeps the caller's order
        order = [specs.index(s) for s in f]
        assert order == sorted(order)


def test_a_tensor_larger_than_a_file_is_never_cut():
    specs = [spec("huge", 700), spec("a", 100), spec("b", 100), spec("c", 100)]
    files = split.plan(specs, 256 * MiB)
    assert len(files) == 3
    assert [s.name for s in files[0]] == ["huge"]
    assert sorted(s.name for f in files[1:] for s in f) == ["a", "b", "c"]


def test_deterministic_and_bounded():
    specs = [spec(f"t{i}", (i % 5) + 1) for i in range(200)]
    assert split.plan(specs, MiB) == split.plan(list(specs), MiB)
    # at most one file per writer thread: a larger state gets larger files, not more
    assert split.MAX_FILES == parallel.WORKERS
    assert len(split.plan(specs, 1)) == split.MAX_FILES
    sizes = [sum(s.nbytes for s in f) for f in split.plan(specs, MiB)]
    assert len(sizes) == split.MAX_FILES and sum(sizes) / len(sizes) >= MiB
    assert len(split.plan([spec("x", 1), spec("y", 1)], 1)) == 2  # never more files than tensors


def test_layouts_first_file_names_the_others_and_the_state_may_refer_to_them():
    specs = [spec(f"t{i}", 1) for i in range(8)]
    state = json.dumps({"components": {"m": {"state": {"t7": {"__tensor__": "t7"}}}}})
    lays = split.layouts(specs, {META_STATE: state}, 2 * MiB)
    assert len(lays) == 4
    tensors, meta = parse_header(lays[0].header)
    assert json.loads(meta[META_FILES]) == [list(lay.offsets) for lay in lays[1:]]
    # and their shapes, from which the service summarises the rank's shards (layout.of_header)
    assert sibling_shapes(meta) == {n: t["shape"] for lay in lays[1:] for n, t in parse_header(lay.header)[0].items()}
    assert "t7" not in tensors
    parse_state(meta, tensors)  # t7 is in another file of the rank: accepted
    for lay in lays[1:]:
        assert META_STATE not in parse_header(lay.header)[1]
    with pytest.raises(FormatError, match="does not hold"):
        parse_state({META_STATE: state}, tensors)  # control: named nowhere


def test_names_and_offsets():
    assert format.file_names("rank00003.safetensors", 3) == [
        "rank00003.safetensors", "rank00003-001.safetensors", "rank00003-002.safetensors"]
    assert format.is_sibling("rank00003.safetensors", "rank00003-002.safetensors")
    assert not format.is_sibling("rank00003.safetensors", "rank00013-002.safetensors")
    assert not format.is_sibling("rank00003.safetensors", "rank00003.safetensors")
    a = split.ALIGN
    at = split.offsets([10, a, 1])
    assert at == [0, a, 2 * a, 3 * a] and a % 64 == 0


def test_bad_files_key_is_a_format_error():
    with pytest.raises(FormatError):
        parse_state({META_STATE: "{}", META_FILES: '{"a": 1}'}, {})
    with pytest.raises(FormatError, match="two files"):
        parse_state({META_STATE: "{}", META_FILES: '[["a"], ["a"]]'}, {})


def test_run_all_waits_for_every_call_then_undoes_the_ones_that_succeeded():
    """A file that fails to prepare: the others finish first, then what they left (spool
    files) is discarded, and the first error is raised."""
    import threading

    started = threading.Barrier(3, timeout=10)  # all three run at once
    done, undone = [], []

    def ok(i):
        started.wait()
        done.append(i)
        return i

    def bad():
        started.wait()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        parallel.run_all([lambda: ok(0), bad, lambda: ok(2)], workers=3, undo=undone.append)
    assert sorted(done) == [0, 2] and sorted(undone) == [0, 2]
    assert parallel.run_all([lambda: 7, lambda: 8], workers=3) == [7, 8]


class _Files:
    """A transport's read_file over bytes in memory: what a rank's restore reads."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def read_file(self, cid, rank, name, size, into):
        into[:size] = self.files[name]
        return into[:size], hash_bytes(self.files[name])


def test_a_first_file_naming_further_files_the_manifest_lacks_is_corrupt():
    """The manifest lists only the first file of the rank, whose header names further files:
    CorruptCheckpoint (restore falls back to an older checkpoint), never a KeyError later."""
    specs = [spec(f"t{i}", 1) for i in range(4)]
    lays = split.layouts(specs, {META_STATE: json.dumps({"components": {}})}, 2 * MiB)
    assert len(lays) == 2
    first = lays[0].header + bytes(lays[0].size - len(lays[0].header))
    name = "rank00000.safetensors"
    man = Manifest(1, "run", 1, "a", 1, None, {0: [FileEntry(name, len(first), hash_bytes(first))]})
    with pytest.raises(CorruptCheckpoint, match="further files"):
        files.fetch_rank(_Files({name: first}), man, 0, name, lambda n: torch.empty(n, dtype=torch.uint8))
    # control: a file that names none restores as one file
    one = split.layouts(specs, {META_STATE: json.dumps({"components": {}})}, 0)[0]
    whole = one.header + bytes(one.size - len(one.header))
    man = Manifest(1, "run", 1, "a", 1, None, {0: [FileEntry(name, len(whole), hash_bytes(whole))]})
    stored, _ = files.fetch_rank(_Files({name: whole}), man, 0, name, lambda n: torch.empty(n, dtype=torch.uint8))
    assert sorted(stored.tensors) == [f"t{i}" for i in range(4)]


def test_a_rank_gets_a_file_per_core_it_has_on_its_host(monkeypatch):
    """The most files a state is split into: the CPUs this process may use over the host's
    ranks (torchrun's LOCAL_WORLD_SIZE), 1 to MAX_FILES; the plan never exceeds it."""
    assert split.files_per_rank(cpus=2, local_ranks=1) == 2
    assert split.files_per_rank(cpus=2, local_ranks=4) == 1
    assert split.files_per_rank(cpus=96, local_ranks=8) == split.MAX_FILES
    assert split.files_per_rank(cpus=1, local_ranks=1) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    import os

    assert split.files_per_rank() == max(1, min(split.MAX_FILES, len(os.sched_getaffinity(0)) // 8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert split.files_per_rank(cpus=4) == 4
    specs = [TensorSpec(f"t{i}", "F32", (256,)) for i in range(16)]  # 16 KiB
    assert len(split.plan(specs, 1024, max_files=2)) == 2 and len(split.plan(specs, 1024)) == split.MAX_FILES
