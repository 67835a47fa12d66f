"""Where a file's DTensor shards lie, as the root says it (lastgood/wire/layout.py): a few
entries per file, grouped by global shape, and a test that keeps every file that may hold
part of a region (a superset), never fewer."""

from __future__ import annotations

from lastgood.wire.layout import MAX_CHUNKS, overlaps, summarize

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
    from lastgood.wire.manifest import FileEntry
    from lastgood.restore.readplan import _needed

    ref = {"xxh3_128": "0" * 32, "size": 10, "tensors": 1}
    before = [FileEntry("f", 1, "0" * 32, index=ref) for _ in range(3)]
    assert _needed(before, []) == [0, 1, 2]
    mixed = [FileEntry("f", 1, "0" * 32, index={**ref, "chunks": {}}), *before[1:]]
    assert _needed(mixed, []) == [0, 1, 2]
    now = [FileEntry("f", 1, "0" * 32, index={**ref, "chunks": {}}) for _ in range(3)]
    assert _needed(now, []) == []  # nothing sharded to place: the source alone


def test_chunks_out_of_their_tensors_bounds_give_no_summary():
    """What the service puts in the root is bounded: as many offsets and lengths as the
    global shape has dims, within it, at most MAX_DIMS, a key of at most MAX_KEY characters."""
    from lastgood.wire.format import MAX_DIMS
    from lastgood.wire.layout import MAX_KEY

    t = {"w": {"shape": [8, 4]}}
    assert summarize({"w": dt("w", [32, 4], [24, 0])}, t) == {"32,4": [[[24, 0], [8, 4]]]}  # the control
    for shape, offset in (([32, 4], [8]), ([32, 4], [8, 0, 0]), ([32], [8, 0]), ([32, 4], [25, 0]),
                          ([32, 4], [-1, 0]), ([32, 4], [8, 1]), ([7, 4], [0, 0])):
        assert summarize({"w": dt("w", shape, offset)}, t) is None, (shape, offset)
    deep = [1] * (MAX_DIMS + 1)
    assert summarize({"w": dt("w", deep, [0] * len(deep))}, {"w": {"shape": deep}}) is None
    wide = [10 ** 18] * 8
    assert len(",".join(map(str, wide))) > MAX_KEY
    assert summarize({"w": dt("w", wide, [0] * 8)}, {"w": {"shape": [1] * 8}}) is None


def test_a_malformed_chunks_value_in_the_root_plans_with_every_old_file():
    """The root's hash is checked, so a malformed `chunks` is a service bug or a later
    format: never a TypeError in restore, every old file's metadata fetched instead."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lastgood.state.codec import ShardRef
    from lastgood.wire.manifest import FileEntry
    from lastgood.restore.readplan import _needed

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        live = distribute_tensor(torch.zeros(32, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        pairs = [(ShardRef("w", (32, 4), (0, 0)), live)]
        ref = {"xxh3_128": "0" * 32, "size": 10, "tensors": 1}

        def files(bad):
            return [FileEntry("f", 1, "0" * 32, index={**ref, "chunks": c})
                    for c in ({"32,4": [[[0, 0], [16, 4]]]}, {"32,4": [[[16, 0], [16, 4]]]}, bad)]

        assert _needed(files({"8": [[[0], [8]]]}), pairs) == [0, 1]  # the control: file 2 holds none of it
        for bad in ([], {"32,4": [[0, [16, 4]]]}, {"32,4": [[[0, 0]]]}, {"32,4": "x"}, {"32,4": [[[0], [16]]]},
                    {7: []}, "x"):
            assert _needed(files(bad), pairs) == [0, 1, 2], bad
    finally:
        dist.destroy_process_group()


def test_a_split_ranks_first_file_is_summarised_for_its_further_files_by_the_shapes_it_declares():
    """The first file of a rank split into files (state/split.py) holds the state; its further
    files' tensors are summarised by META_FILE_SHAPES. Without that key (written before it)
    it has no summary, as before; a malformed one gives none, and never refuses the file."""
    import json

    from lastgood.wire.format import META_FILE_SHAPES, META_FILES, META_STATE
    from lastgood.wire.layout import of_header

    own = {"b": TENSORS["b"], "e": TENSORS["e"], "step": TENSORS["step"]}
    meta = {META_STATE: json.dumps(STATE), META_FILES: json.dumps([["w"], ["w.exp_avg"]])}
    assert of_header(meta, own) is None  # before the shapes: a tensor of the state it cannot size
    shaped = {**meta, META_FILE_SHAPES: json.dumps([[[8, 4]], [[8, 4]]])}
    assert of_header(shaped, own) == summarize(STATE, TENSORS)
    for bad in ("[[[8, 4]]]", "[[[8, 4]], [[8, -1]]]", "[[[8, 4]], [\"x\"]]", "{", "7"):
        assert of_header({**meta, META_FILE_SHAPES: bad}, own) is None, bad
