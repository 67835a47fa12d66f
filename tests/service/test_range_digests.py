"""Range digests written with each file's tensor index object (lastgood/ranges.py): computed
by the service from the stream it checks against the client's hash, they verify ranged
reads of the stored bytes; LASTGOOD_RANGE_BLOCK_BYTES=0 writes none (the format before)."""

from __future__ import annotations

from lastgood.hashing import hash_bytes
from lastgood.manifest import Manifest
from lastgood.ranges import MIN_BLOCK, RangeDigests

from .helpers import Client, http, make_shard, shard_name


def test_each_segment_of_a_ranged_read_verifies(make_service, run_name):
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES=str(MIN_BLOCK))
    data = make_shard(0, n=5000)  # a 20 KB tensor: five blocks
    with Client(svc.grpc_target) as c:
        cid = c.begin(run_name, 1, 1).checkpoint_id
        c.put(cid, 0, shard_name(0), data, chunk=1000)
        assert c.vote(cid, 0, [shard_name(0)], wait=2.0).status == "COMMITTED"
    root = Manifest.from_bytes(http(svc).get(f"/api/v1/checkpoints/{cid}/manifest").content)
    body = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/index/{shard_name(0)}").content
    entry = root.files(0)[0].with_index(0, body)
    assert entry.digests["block"] == MIN_BLOCK and b'"digests"' not in root.to_bytes()  # in the index object only
    rd = RangeDigests(entry.data_start, entry.tensors, entry.digests)
    a, b = entry.data_start + 3, len(data) - 5
    segs = rd.covering(a, b)
    assert len(segs) > 4
    with Client(svc.grpc_target) as c:
        for seg, want in segs:
            got = c.read(cid, 0, shard_name(0), offset=seg.start, length=seg.end - seg.start)
            assert got == data[seg.start:seg.end] and hash_bytes(got) == want


def test_block_zero_writes_no_digests(make_service, run_name):
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES="0")
    with Client(svc.grpc_target) as c:
        cid, _ = c.save(run_name, step=1)
    body = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/index/{shard_name(0)}").content
    assert b'"digests"' not in body and b'"tensors"' in body


def test_a_block_under_the_floor_is_refused_at_start():
    """A 1-byte block would keep 36 B of digest per byte of a file while it streams in: the
    settings refuse anything between 0 (no digests) and MIN_BLOCK."""
    import pytest
    from pydantic import ValidationError

    from lastgood_service.settings import Settings

    for ok in (0, MIN_BLOCK, 1024 * 1024):
        assert Settings(range_block_bytes=ok).range_block_bytes == ok
    for bad in (1, 64, MIN_BLOCK - 1):
        with pytest.raises(ValidationError, match="at least 4096"):
            Settings(range_block_bytes=bad)
