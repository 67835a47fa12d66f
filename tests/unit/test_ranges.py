"""Range digests (lastgood/wire/ranges.py): the segments of a file, their digests computed from
any chunking of the stream, and which segments verify a byte range."""

from __future__ import annotations

import pytest

from lastgood.errors import FormatError
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.ranges import HEADER, RangeDigests, RangeHasher, segments

DATA_START = 16
TENSORS = {"a": {"offsets": [0, 10]}, "b": {"offsets": [10, 10]}, "c": {"offsets": [10, 35]}}  # b is empty
FILE = bytes(range(DATA_START + 35))


def digests(block: int, chunk: int) -> dict:
    h = RangeHasher(DATA_START, TENSORS, block)
    for i in range(0, len(FILE), chunk):
        h.update(FILE[i:i + chunk])
    return h.digests()


def test_segments_cut_each_tensor_from_its_own_start_and_never_straddle_two():
    segs = [(s.name, s.start, s.end) for s in segments(DATA_START, TENSORS, 8)]
    assert segs == [(HEADER, 0, 16), ("a", 16, 24), ("a", 24, 26),
                    ("c", 26, 34), ("c", 34, 42), ("c", 42, 50), ("c", 50, 51)]


@pytest.mark.parametrize("chunk", [1, 7, 8, 1000])
def test_digests_do_not_depend_on_how_the_stream_is_cut(chunk):
    d = digests(8, chunk)
    assert d == digests(8, 3)
    assert d["block"] == 8 and d["header"] == hash_bytes(FILE[:16])
    assert d["tensors"]["a"] == [hash_bytes(FILE[16:24]), hash_bytes(FILE[24:26])]
    assert "b" not in d["tensors"] and len(d["tensors"]["c"]) == 4


def test_a_range_is_verified_by_the_segments_that_cover_it():
    rd = RangeDigests(DATA_START, TENSORS, digests(8, 5))
    assert [(s.start, s.end) for s, _ in rd.covering(30, 36)] == [(26, 34), (34, 42)]
    assert [(s.start, s.end) for s, _ in rd.covering(0, 16)] == [(0, 16)]  # the header alone
    for seg, want in rd.covering(0, len(FILE)):
        assert hash_bytes(FILE[seg.start:seg.end]) == want
    with pytest.raises(ValueError):
        rd.covering(40, 52)


def test_digests_that_do_not_fit_the_index_are_a_format_error():
    d = digests(8, 5)
    with pytest.raises(FormatError):
        RangeDigests(DATA_START, TENSORS, {**d, "tensors": {**d["tensors"], "c": d["tensors"]["c"][:3]}})
    with pytest.raises(FormatError):
        RangeDigests(DATA_START, TENSORS, {**d, "header": "not hex"})
    with pytest.raises(FormatError):
        RangeDigests(DATA_START, TENSORS, {**d, "block": 0})


def test_a_stream_longer_or_shorter_than_its_segments_is_refused():
    h = RangeHasher(DATA_START, TENSORS, 8)
    h.update(FILE[:-1])
    with pytest.raises(FormatError):
        h.digests()
    h.update(FILE[-1:])
    with pytest.raises(FormatError):
        h.update(b"x")


class CountedName(str):
    """A tensor name that counts how often it is compared with another name."""

    compares = 0

    def __eq__(self, other):
        CountedName.compares += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_checking_a_large_digest_table_is_linear_in_its_segments():
    """Every rank checks every old file's table: 4,000 one-block tensors must cost a few
    name comparisons each, not one per segment of the file (quadratic: 16 million)."""
    n = 4000
    tensors = {CountedName(f"t{i}"): {"offsets": [8 * i, 8 * i + 8]} for i in range(n)}
    table = {"block": 8, "header": hash_bytes(b"h"), "tensors": {str(k): [hash_bytes(b"x")] for k in tensors}}
    CountedName.compares = 0
    RangeDigests(DATA_START, tensors, table)
    assert CountedName.compares < 10 * n, CountedName.compares


def test_a_tensors_block_is_about_a_32nd_of_it_within_the_floor_and_the_cap():
    """The rule (block_for): the largest power of two <= size / 32, at least FLOOR, at most
    the cap; the cap wins over the floor (a service set to 4 KiB blocks gets 4 KiB)."""
    from lastgood.wire.ranges import DEFAULT_BLOCK, FLOOR, MiB, block_for

    assert block_for(1 * MiB, DEFAULT_BLOCK) == 32 * 1024
    assert block_for(1 * MiB - 1, DEFAULT_BLOCK) == 16 * 1024
    assert block_for(100, DEFAULT_BLOCK) == FLOOR
    assert block_for(1024 * MiB, DEFAULT_BLOCK) == DEFAULT_BLOCK
    assert block_for(1 * MiB, 4096) == 4096 and block_for(1 * MiB, 8, None) == 8
    for size in (FLOOR * 32, 3 * MiB + 5, 32 * MiB, 33 * MiB):
        b = block_for(size, DEFAULT_BLOCK)
        assert b <= size // 32 and b & (b - 1) == 0 and (b == DEFAULT_BLOCK or 2 * b > size // 32)


@pytest.mark.parametrize("stored", [256 * 1024, 1024 * 1024, 3 * 1024 * 1024 + 4])
def test_at_the_default_a_range_inside_a_tensor_reads_at_most_a_32nd_more_at_each_cut_end(stored):
    """The bound the read plan's 1.1x rests on: a rank's stored piece of a tensor, smaller
    than the default cap (1 MiB), is not read whole for a part of it (at 4 -> 3 ranks it
    was: 1.5x the bytes needed)."""
    from lastgood.wire.ranges import DEFAULT_BLOCK

    tensors = {"w": {"offsets": [0, stored]}}
    h = RangeHasher(DATA_START, tensors, DEFAULT_BLOCK)
    h.update(bytes(DATA_START + stored))
    rd = RangeDigests(DATA_START, tensors, h.digests())
    a, b = DATA_START + stored // 3, DATA_START + stored - 1000  # both ends cut inside the tensor
    segs = rd.covering(a, b)
    extra = (segs[-1][0].end - segs[0][0].start) - (b - a)
    assert extra <= 2 * max(16 * 1024, stored // 32), (stored, extra)


def test_index_objects_of_one_fixed_block_still_verify():
    """Digests written before the rule (one block for every tensor, no "split") are read
    with that block; the same bytes under the rule make other segments."""
    h = RangeHasher(DATA_START, TENSORS, 8, split=None)
    h.update(FILE)
    d = h.digests()
    assert "split" not in d and d["block"] == 8
    rd = RangeDigests(DATA_START, TENSORS, d)
    assert [(s.start, s.end) for s, _ in rd.covering(30, 36)] == [(26, 34), (34, 42)]
    for seg, want in rd.covering(0, len(FILE)):
        assert hash_bytes(FILE[seg.start:seg.end]) == want
    with pytest.raises(FormatError):
        RangeDigests(DATA_START, TENSORS, {**d, "split": 4, "floor": 2})  # the same digests under a rule: misfit


def test_the_hasher_keeps_16_bytes_a_segment_until_the_index_object_is_written():
    """The service holds a file's digests while it streams in: as raw bytes (16 a segment),
    not hex strings (~90 B each with their list slot), which at 16 KiB blocks were ~5.6 MB
    per GiB of tensors. Up to the hex at the end, the same digests."""
    import tracemalloc

    from lastgood.wire.ranges import MIN_BLOCK

    n = 4096
    tensors = {"w": {"offsets": [0, n * MIN_BLOCK]}}
    head, chunk = bytes(range(8)), bytes(range(256)) * 4096  # 1 MiB
    tracemalloc.start()
    try:
        h = RangeHasher(8, tensors, MIN_BLOCK)
        h.update(head)
        for _ in range(n * MIN_BLOCK // len(chunk)):
            h.update(chunk)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 24 * n, held
    d = h.digests()
    assert len(d["tensors"]["w"]) == n and d["tensors"]["w"][1] == hash_bytes(chunk[MIN_BLOCK:2 * MIN_BLOCK])
    assert d["header"] == hash_bytes(head)
