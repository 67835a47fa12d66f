"""A vote that carries its small files (CommitRank.inline_files): each is taken as a streamed
PutShard takes one (hashed, published durably, recorded VERIFIED) before the vote counts, so
a small state's save is two calls, begin and vote. Bad input is refused with a clear error
and changes nothing, and the refused vote does not count."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from lastgood.wire.hashing import hash_bytes
from lastgood.wire.v1 import lastgood_pb2 as pb

from .helpers import (RPC_TIMEOUT, assert_unchanged, events, last_good_id, make_shard, rpc_error,
                      shard_name, snapshot)

SC = grpc.StatusCode


def vote(cl, cid: int, rank: int, files: list[str], inline: list[tuple[str, bytes]], *, wait: float = 2.0,
         digests: dict[str, str] | None = None, memory: bool = False) -> pb.CommitRankResponse:
    digests = digests or {}
    return cl.stub.CommitRank(pb.CommitRankRequest(
        checkpoint_id=cid, rank=rank, files=files, wait_seconds=wait,
        inline_files=[pb.InlineFile(name=n, xxh3_128=digests.get(n, hash_bytes(d)), data=d) for n, d in inline],
        memory_files=[pb.MemoryFile(name=n, size=len(d), xxh3_128=hash_bytes(d)) for n, d in inline] if memory else []),
        timeout=RPC_TIMEOUT + wait)


def test_the_service_offers_inline_files_up_to_its_limit(svc):
    info = httpx.get(f"{svc.url}/api/v1/info").json()
    assert info["inline_bytes"] == 1024 * 1024


def test_a_vote_carrying_its_files_commits_them_verified_and_a_resent_vote_changes_nothing(svc, cl, run_name):
    data, extra = make_shard(0, seed=3), b"a small second file of the rank"
    cid = cl.begin(run_name).checkpoint_id
    res = vote(cl, cid, 0, [shard_name(0), "extra.bin"], [(shard_name(0), data), ("extra.bin", extra)])
    assert res.status == "COMMITTED", res
    assert last_good_id(svc, run_name) == cid
    assert cl.read(cid, 0, shard_name(0)) == data and cl.read(cid, 0, "extra.bin") == extra
    shards = httpx.get(f"{svc.url}/api/v1/checkpoints/{cid}/shards").json()
    files = {f["name"]: f for f in shards["ranks"][0]["files"]}
    assert files[shard_name(0)]["xxh3_128"] == hash_bytes(data) and files[shard_name(0)]["status"] == "VERIFIED"
    assert shards["ranks"][0]["voted"] and files["extra.bin"]["size"] == len(extra)
    # the safetensors file's tensor index was stored as a streamed file's is: the manifest knows its tensors
    entries = {f["name"]: f for r in json.loads(cl.manifest(cid).manifest)["ranks"] for f in r["files"]}
    assert entries[shard_name(0)]["index"]["tensors"] == 3 and "index" not in entries["extra.bin"]
    # the reply was lost, say: the same vote again finds its files present and the checkpoint committed
    before = snapshot(svc, run_name)
    assert vote(cl, cid, 0, [shard_name(0), "extra.bin"], [(shard_name(0), data), ("extra.bin", extra)]).status \
        == "COMMITTED"
    assert_unchanged(before, snapshot(svc, run_name))


def test_ranks_may_carry_some_files_and_stream_others(svc, cl, run_name):
    cid = cl.begin(run_name, world_size=2).checkpoint_id
    cl.put(cid, 0, "streamed.bin", b"streamed first")
    assert vote(cl, cid, 0, ["streamed.bin", shard_name(0)], [(shard_name(0), make_shard(0))], wait=0).status \
        == "PENDING"
    cl.put(cid, 1, shard_name(1), make_shard(1))
    assert cl.vote(cid, 1, [shard_name(1)], wait=2).status == "COMMITTED"
    assert cl.read(cid, 0, "streamed.bin") == b"streamed first"


BIG = 1024 * 1024 + 1


@pytest.mark.parametrize("case", ["wrong-hash", "over-the-limit", "not-among-the-files", "named-twice", "bad-name",
                                  "not-safetensors", "with-memory-files", "after-a-vote", "second-file-bad-hash",
                                  "second-file-not-safetensors"])
def test_a_vote_with_bad_inline_files_is_refused_and_changes_nothing(svc, cl, run_name, case):
    data = make_shard(0)
    cid = cl.begin(run_name, world_size=2).checkpoint_id
    files, inline, digests, memory = [shard_name(0)], [(shard_name(0), data)], {}, False
    code = SC.INVALID_ARGUMENT
    if case == "wrong-hash":
        digests, code = {shard_name(0): hash_bytes(b"other bytes")}, SC.DATA_LOSS
    elif case == "over-the-limit":
        files, inline, code = ["big.bin"], [("big.bin", b"\0" * BIG)], SC.RESOURCE_EXHAUSTED
    elif case == "not-among-the-files":
        files = []
    elif case == "named-twice":
        inline = [(shard_name(0), data), (shard_name(0), data)]
    elif case == "bad-name":
        files, inline = ["../escape.bin"], [("../escape.bin", b"x")]
    elif case == "not-safetensors":
        inline = [(shard_name(0), b"not a safetensors file at all")]
    elif case == "with-memory-files":
        memory = True
    elif case.startswith("second-file"):  # the good first file is not recorded either
        files = [shard_name(0), "b.safetensors"]
        inline = [(shard_name(0), data), ("b.safetensors", data if case.endswith("hash") else b"\0" * 64)]
        if case.endswith("hash"):
            digests, code = {"b.safetensors": hash_bytes(b"other bytes")}, SC.DATA_LOSS
    elif case == "after-a-vote":  # the rank voted already: its vote named all its files
        assert cl.vote(cid, 0, [], wait=0).status == "PENDING"
        code = SC.FAILED_PRECONDITION
    before = snapshot(svc, run_name)
    rpc_error(code, vote, cl, cid, 0, files, inline, wait=0, digests=digests, memory=memory)
    assert_unchanged(before, snapshot(svc, run_name))
    if case in ("wrong-hash", "second-file-bad-hash"):  # recorded as a streamed file's mismatch is
        assert [e["data"]["received"] for e in events(svc, run_name) if e["kind"] == "hash_mismatch"] == \
            [hash_bytes(data)]
    if case == "after-a-vote":
        return
    # CONTROL: the refused vote did not count, and the same rank's good vote does
    assert list(cl.vote(cid, 1, [], wait=0).missing_ranks) == [0]
    assert vote(cl, cid, 0, [shard_name(0)], [(shard_name(0), data)]).status == "COMMITTED"


@pytest.mark.slow
def test_a_service_with_inline_files_off_refuses_them(make_service, run_name):
    from .helpers import Client

    svc = make_service(LASTGOOD_INLINE_BYTES="0")
    assert httpx.get(f"{svc.url}/api/v1/info").json()["inline_bytes"] == 0
    with Client(svc.grpc_target) as c:
        cid = c.begin(run_name).checkpoint_id
        before = snapshot(svc, run_name)
        rpc_error(SC.RESOURCE_EXHAUSTED, vote, c, cid, 0, ["x.bin"], [("x.bin", b"x")])
        assert_unchanged(before, snapshot(svc, run_name))
        c.put(cid, 0, "x.bin", b"x")  # CONTROL: streamed, the same file commits
        assert c.vote(cid, 0, ["x.bin"], wait=2).status == "COMMITTED"


def test_the_inline_limit_follows_a_smaller_chunk_and_a_larger_one_is_refused_at_start():
    from pydantic import ValidationError

    from lastgood_service.settings import Settings

    assert Settings().inline_bytes == 1024 * 1024
    assert Settings(max_chunk_bytes=65536).inline_bytes == 65536  # a vote is one message: at most a chunk
    assert Settings(inline_bytes=0).inline_bytes == 0
    with pytest.raises(ValidationError, match="inline_bytes=2097152 exceeds max_chunk_bytes=1048576"):
        Settings(inline_bytes=2 * 1024 * 1024, max_chunk_bytes=1024 * 1024)
