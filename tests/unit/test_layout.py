"""Where a file's DTensor shards lie, as the root says it (lastgood/layout.py): a few
entries per file, grouped by global shape, and a test that keeps every file that may hold
part of a region (a superset), never fewer."""

from __future__ import annotations

from lastgood.layout import MAX_CHUNKS, overlaps, summarize

TENSORS = {"w": {"shape": [8, 4]}, "w.exp_avg": {"shape": [8, 4]}, "b": {"shape": [8]}, "step": {"shape": []},
           "e": {"shape": [0, 4]}}


def dt(name: str, shape: list, offset: list) -> dict:
    return {"__dtensor__": name, "shape": shape, "offset": offset}


STATE = {"components": {"model": {"state": {"w": dt("w", [32, 4], [8, 0]), "b": dt("b", [32], [8]),
                                            "e": dt("e", [30, 4], [30, 0])}},
                        "optimizer": {"state": [{"exp_avg": dt("w.exp_avg", [32, 4], [8, 0]),
                                                 "step": {"__tensor__": "step"}}]}}}


def test_a_weight_and_its_moment_share_one_entry_by_global_shape():
    assert summarize(STATE, TENSORS) == {"30,4": [[[30, 0], [0, 4]]], "32": [[[8], [8]]],
                                         "32,4": [[[8, 0], [8, 4]]]}
    assert summarize({"components": {}}, {}) == {}


def test_too_many_distinct_chunks_or_a_malformed_one_give_no_summary():
    many = {"components": {str(i): dt("b", [i + 1], [0]) for i in range(MAX_CHUNKS + 1)}}
    assert summarize(many, {"b": {"shape": [1]}}) is None
    assert summarize({"x": dt("missing", [4], [0])}, TENSORS) is None


def test_a_file_is_kept_when_one_of_its_chunks_of_that_shape_overlaps_the_region():
    c = summarize(STATE, TENSORS)
    assert overlaps(c, [32, 4], [0, 0], [9, 4]) and overlaps(c, [32, 4], [15, 0], [10, 4])
    assert not overlaps(c, [32, 4], [0, 0], [8, 4]) and not overlaps(c, [32, 4], [16, 0], [16, 4])
    assert not overlaps(c, [32, 5], [0, 0], [32, 5])  # no tensor of that shape
    assert not overlaps(c, [32], [8], [0])  # an empty region needs no file
    assert not overlaps(c, [30, 4], [0, 0], [30, 4])  # an empty chunk holds nothing


def test_a_root_written_before_chunks_plans_with_every_old_file():
    """Roots committed before `chunks` (or a file with too many to summarise) still restore
    at another world size: every old file's metadata is fetched, as before; with them, only
    the files that may overlap."""
    from lastgood.manifest import FileEntry
    from lastgood.readplan import _needed

    ref = {"xxh3_128": "0" * 32, "size": 10, "tensors": 1}
    before = [FileEntry("f", 1, "0" * 32, index=ref) for _ in range(3)]
    assert _needed(before, []) == [0, 1, 2]
    mixed = [FileEntry("f", 1, "0" * 32, index={**ref, "chunks": {}}), *before[1:]]
    assert _needed(mixed, []) == [0, 1, 2]
    now = [FileEntry("f", 1, "0" * 32, index={**ref, "chunks": {}}) for _ in range(3)]
    assert _needed(now, []) == []  # nothing sharded to place: the source alone
