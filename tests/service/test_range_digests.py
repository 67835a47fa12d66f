"""Range digests written with each file's tensor index object (lastgood/wire/ranges.py): computed
by the service from the stream it checks against the client's hash, they verify ranged
reads of the stored bytes; LASTGOOD_RANGE_BLOCK_BYTES=0 writes none (the format before)."""

from __future__ import annotations

from dataclasses import replace

from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import RANGE_DIGESTS, Manifest
from lastgood.wire.ranges import MIN_BLOCK, RangeDigests

from .helpers import Client, http, make_shard, safetensors_bytes, shard_name


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
    assert b'"digests"' not in body and RANGE_DIGESTS.encode() not in body and b'"tensors"' in body


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


def sharded_file(offset: str = "[4, 0]") -> bytes:
    """A shard file as a rank of an FSDP2 job writes it: rows 4..7 of a 16 x 2 weight and of
    its Adam moment (DTensor shards, one global shape), and a plain step; `offset` the
    weight's, as JSON text."""
    import json

    import numpy as np

    from lastgood.wire.format import META_STATE

    values = {"w": np.ones((4, 2), np.float32), "w.exp_avg": np.zeros((4, 2), np.float32),
              "step": np.array([3], np.int64)}
    state = {"components": {"model": {"w": {"__dtensor__": "w", "shape": [16, 2], "offset": [4, 0]}},
                            "optim": {"m": {"__dtensor__": "w.exp_avg", "shape": [16, 2], "offset": [4, 0]},
                                      "step": {"__tensor__": "step"}}}}
    return safetensors_bytes(values, {META_STATE: json.dumps(state).replace('"offset": [4, 0]', f'"offset": {offset}', 1)})


def commit_one(svc, run_name: str, data: bytes) -> Manifest:
    with Client(svc.grpc_target) as c:
        cid = c.begin(run_name, 1, 1).checkpoint_id
        c.put(cid, 0, shard_name(0), data)
        assert c.vote(cid, 0, [shard_name(0)], wait=2.0).status == "COMMITTED"
    return Manifest.from_bytes(http(svc).get(f"/api/v1/checkpoints/{cid}/manifest").content)


def test_the_root_says_where_each_files_shards_lie(make_service, run_name):
    """The root's index reference carries the file's DTensor chunks by global shape
    (lastgood/wire/layout.py), a few bytes a file: a rank restoring at another world size
    fetches only the index objects of the files it overlaps. Without range digests
    (block 0) there is none: such files are read whole anyway."""
    root = commit_one(make_service(), run_name, sharded_file())
    assert root.files(0)[0].index["chunks"] == {"16,2": [[[4, 0], [4, 2]]]}
    bare = root.ranks[0][0].index.copy()
    del bare["chunks"]
    assert len(root.to_bytes()) - len(replace(root, ranks={0: [replace(root.files(0)[0], index=bare)]}).to_bytes()) < 40
    root = commit_one(make_service(LASTGOOD_RANGE_BLOCK_BYTES="0"), run_name, sharded_file())
    assert "chunks" not in root.files(0)[0].index


def old_reader_digests(body: bytes):
    """What a client from before the per-tensor block rule made of an index object (a
    copy of its logic, cff203b: manifest.FileEntry.with_index and ranges.RangeDigests):
    the `digests` key, one block for every tensor; a segment count that does not fit was
    FormatError, i.e. a damaged checkpoint to fall back from."""
    import json

    d = json.loads(body)
    digests = d.get("digests")
    if digests is None:
        return None  # read whole, as before digests
    block = digests["block"]
    for name, t in d["tensors"].items():
        a, b = t["offsets"]
        want = -(-(b - a) // block)
        if b > a and len(digests["tensors"][name]) != want:
            raise AssertionError(f"old client: tensor {name!r}: {len(digests['tensors'][name])} digests for "
                                 f"{want} segments -> FormatError, checkpoint treated as damaged")
    return digests


def test_a_client_from_before_the_block_rule_reads_new_index_objects_whole(make_service, run_name):
    """Index objects keep `lastgood.index/1`; the per-tensor block rule's digests go under
    a key an old client does not know (manifest.RANGE_DIGESTS), so it reads such files
    whole instead of finding a segment-count mismatch and falling back from every new
    checkpoint. A new client reads them."""
    svc = make_service()  # the default cap: a 100 KB tensor gets 16 KiB blocks, 7 segments
    data = make_shard(0, n=25_000)
    with Client(svc.grpc_target) as c:
        cid = c.begin(run_name, 1, 1).checkpoint_id
        c.put(cid, 0, shard_name(0), data)
        assert c.vote(cid, 0, [shard_name(0)], wait=2.0).status == "COMMITTED"
    root = Manifest.from_bytes(http(svc).get(f"/api/v1/checkpoints/{cid}/manifest").content)
    body = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/index/{shard_name(0)}").content
    assert old_reader_digests(body) is None
    entry = root.files(0)[0].with_index(0, body)
    assert entry.digests["split"] and len(RangeDigests(entry.data_start, entry.tensors, entry.digests)
                                          .covering(entry.data_start, len(data))) > 7


def test_a_shard_offset_too_large_for_an_int_gets_no_chunks_not_an_internal_error(make_service, run_name):
    """JSON's 1e400 parses as inf, and int(inf) raised OverflowError outside the header's
    guard: put_shard failed INTERNAL. The file is stored; its summary is left out (restore
    plans with every old file and finds out on its own)."""
    svc = make_service()
    root = commit_one(svc, run_name, sharded_file("[1e400, 0]"))
    assert "chunks" not in root.files(0)[0].index
    assert commit_one(svc, run_name + "-control", sharded_file()).files(0)[0].index["chunks"]
