"""Range digests written with each file's tensor index object (lastgood/ranges.py): computed
by the service from the stream it checks against the client's hash, they verify ranged
reads of the stored bytes; LASTGOOD_RANGE_BLOCK_BYTES=0 writes none (the format before)."""

from __future__ import annotations

from lastgood.hashing import hash_bytes
from lastgood.manifest import Manifest
from lastgood.ranges import RangeDigests

from .helpers import Client, http, shard_name


def test_each_segment_of_a_ranged_read_verifies(make_service, run_name):
    svc = make_service(LASTGOOD_RANGE_BLOCK_BYTES="8")
    with Client(svc.grpc_target) as c:
        cid, shards = c.save(run_name, step=1)
    data = shards[0]
    root = Manifest.from_bytes(http(svc).get(f"/api/v1/checkpoints/{cid}/manifest").content)
    body = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/index/{shard_name(0)}").content
    entry = root.files(0)[0].with_index(0, body)
    assert entry.digests["block"] == 8 and b'"digests"' not in root.to_bytes()  # in the index object only
    rd = RangeDigests(entry.data_start, entry.tensors, entry.digests)
    a, b = entry.data_start + 3, len(data) - 5
    segs = rd.covering(a, b)
    assert len(segs) > 2
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
