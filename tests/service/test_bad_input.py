"""Bad input gets a clear error and changes nothing.

Every case takes a snapshot (runs, the run's checkpoints and statuses, last-good, the blob
store's blobs/ and tmp/ files) before and after the rejected request and asserts equality.
The module runs its own service with a long lease, so that no PENDING checkpoint expires
between two snapshots and turns a status change into a false alarm.
"""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest

from lastgood.wire import framing
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.v1 import lastgood_pb2 as pb

from .helpers import (Client, assert_unchanged, checkpoint, http, json_error, last_good_id, make_shard, rpc_error,
                      shard_name, snapshot)

SC = grpc.StatusCode


@pytest.fixture(scope="module")
def committed(svc):
    """One committed single-rank checkpoint: (run, checkpoint id, shard bytes)."""
    c = Client(svc.grpc_target)
    try:
        cid, shards = c.save("bad-input-committed", step=1)
    finally:
        c.close()
    return "bad-input-committed", cid, shards[0]


def _unchanged(svc, before: dict, *runs: str) -> None:
    assert_unchanged(before, snapshot(svc, *runs))


# ---------------------------------------------------------------- unknown names and ids
def test_unknown_run(svc, committed):
    before = snapshot(svc, "no-such-run")
    assert before["runs"]["no-such-run"] is None
    for path in ("/api/v1/runs/no-such-run", "/api/v1/runs/no-such-run/checkpoints",
                 "/api/v1/runs/no-such-run/last-good", "/api/v1/runs/no-such-run/events"):
        err = json_error(http(svc).get(path), 404)
        assert err["code"] == "not_found" and "no-such-run" in err["message"]
    cl = Client(svc.grpc_target)
    try:
        rpc_error(SC.NOT_FOUND, cl.manifest, 0, "no-such-run")
    finally:
        cl.close()
    _unchanged(svc, before, "no-such-run")


def test_unknown_checkpoint_id(svc, cl, committed):
    run, _cid, data = committed
    missing = 987654321
    before = snapshot(svc, run)
    for path in (f"/api/v1/checkpoints/{missing}", f"/api/v1/checkpoints/{missing}/manifest",
                 f"/api/v1/checkpoints/{missing}/ranks/0/files/{shard_name(0)}"):
        err = json_error(http(svc).get(path), 404)
        assert str(missing) in err["message"]
    json_error(http(svc).post(f"/api/v1/checkpoints/{missing}/verify"), 404)

    err = rpc_error(SC.NOT_FOUND, cl.put, missing, 0, shard_name(0), data)
    assert str(missing) in err.details()
    rpc_error(SC.NOT_FOUND, cl.vote, missing, 0, [shard_name(0)])
    rpc_error(SC.NOT_FOUND, cl.manifest, missing)
    rpc_error(SC.NOT_FOUND, cl.read, missing, 0, shard_name(0))
    rpc_error(SC.NOT_FOUND, cl.abort, missing)
    # ids that can never exist: 0 and negative
    rpc_error(SC.NOT_FOUND, cl.put, -5, 0, shard_name(0), data)
    rpc_error(SC.NOT_FOUND, cl.abort, -5)
    _unchanged(svc, before, run)


# ---------------------------------------------------------------- conflicts
def test_same_file_with_different_bytes_is_a_conflict(svc, cl, run_name):
    cid = cl.begin(run_name).checkpoint_id
    original = make_shard(0, seed=1)
    other = make_shard(0, seed=2)
    assert len(original) == len(other) and original != other
    cl.put(cid, 0, shard_name(0), original)

    before = snapshot(svc, run_name)
    err = rpc_error(SC.ALREADY_EXISTS, cl.put, cid, 0, shard_name(0), other)
    assert shard_name(0) in err.details()
    _unchanged(svc, before, run_name)

    assert cl.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    before = snapshot(svc, run_name)
    rpc_error(SC.ALREADY_EXISTS, cl.put, cid, 0, shard_name(0), other)  # after the commit, too
    _unchanged(svc, before, run_name)
    got = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}")
    assert got.status_code == 200 and got.content == original
    assert got.headers["x-lastgood-xxh3-128"] == hash_bytes(original)
    assert cl.read(cid, 0, shard_name(0)) == original


def test_vote_while_ranks_are_missing(svc, cl, run_name):
    cid = cl.begin(run_name, world_size=3).checkpoint_id
    cl.put(cid, 0, shard_name(0), make_shard(0))
    before = snapshot(svc, run_name)
    res = cl.vote(cid, 0, [shard_name(0)], wait=0)
    assert res.status == "PENDING" and list(res.missing_ranks) == [1, 2]
    res = cl.vote(cid, 0, [shard_name(0)], wait=0.3)  # waiting a little changes nothing either
    assert res.status == "PENDING" and list(res.missing_ranks) == [1, 2]
    _unchanged(svc, before, run_name)
    view = checkpoint(svc, cid)
    assert view["status"] == "PENDING" and view["manifest"] is None
    assert last_good_id(svc, run_name) is None
    json_error(http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}"), 409)
    rpc_error(SC.FAILED_PRECONDITION, cl.manifest, cid)
    # a second vote of the same rank with other files contradicts the first; a vote that
    # lists a file twice, one for a file never uploaded, one that leaves an upload out
    cl.put(cid, 1, shard_name(1), make_shard(1))
    before = snapshot(svc, run_name)
    rpc_error(SC.ALREADY_EXISTS, cl.vote, cid, 0, [], wait=0)
    rpc_error(SC.INVALID_ARGUMENT, cl.vote, cid, 1, [shard_name(1), shard_name(1)], wait=0)
    err = rpc_error(SC.FAILED_PRECONDITION, cl.vote, cid, 1, [shard_name(1), "never.bin"], wait=0)
    assert "never.bin" in err.details()
    err = rpc_error(SC.FAILED_PRECONDITION, cl.vote, cid, 1, [], wait=0)
    assert shard_name(1) in err.details()
    _unchanged(svc, before, run_name)
    # none of the refused votes counted: rank 1 is still missing
    assert list(cl.vote(cid, 2, [], wait=0).missing_ranks) == [1]  # rank 2 has no files: an empty vote


def test_a_vote_naming_20000_missing_files_keeps_its_status(svc, cl, run_name):
    """The error text echoes the vote; unbounded it outgrew gRPC's metadata limit and the
    client saw RESOURCE_EXHAUSTED instead of FAILED_PRECONDITION (api/errors.bounded)."""
    cid = cl.begin(run_name).checkpoint_id
    before = snapshot(svc, run_name)
    files = [f"missing-{i:05d}.safetensors" for i in range(20_000)]
    err = rpc_error(SC.FAILED_PRECONDITION, cl.vote, cid, 0, files, wait=0)
    details = err.details()
    assert "missing-00000.safetensors" in details and len(details) < 1200, len(details)
    assert details.endswith(" more characters)"), details[-80:]
    _unchanged(svc, before, run_name)


def test_upload_after_the_rank_voted_is_refused(svc, cl, run_name):
    cid = cl.begin(run_name, world_size=2).checkpoint_id
    for r in (0, 1):
        cl.put(cid, r, shard_name(r), make_shard(r))
    assert cl.vote(cid, 0, [shard_name(0)]).status == "PENDING"
    before = snapshot(svc, run_name)
    try:
        # rank 0 said "these are all my files"; a later file contradicts its vote
        err = rpc_error(SC.FAILED_PRECONDITION, cl.put, cid, 0, "late.bin", b"uploaded after the vote")
        assert "voted" in err.details()
        _unchanged(svc, before, run_name)
    finally:
        # whatever happened, the other rank's vote must still commit the checkpoint
        assert cl.vote(cid, 1, [shard_name(1)], wait=2).status == "COMMITTED"


def test_world_size_mismatch_and_rank_out_of_range(svc, cl, run_name):
    cid = cl.begin(run_name, step=7, world_size=2).checkpoint_id
    before = snapshot(svc, run_name)
    err = rpc_error(SC.ALREADY_EXISTS, cl.begin, run_name, step=7, world_size=4)
    assert "world size" in err.details()
    _unchanged(svc, before, run_name)

    data = make_shard(2)
    for rank in (2, 3, -1):
        err = rpc_error(SC.INVALID_ARGUMENT, cl.put, cid, rank, shard_name(2), data)
        assert "rank" in err.details()
        rpc_error(SC.INVALID_ARGUMENT, cl.vote, cid, rank, [], wait=0)
    rpc_error(SC.INVALID_ARGUMENT, cl.begin, run_name, step=8, world_size=2, rank=2)
    _unchanged(svc, before, run_name)
    res = cl.vote(cid, 0, [], wait=0)  # CONTROL: an in-range rank is heard
    assert list(res.missing_ranks) == [1]


def test_vote_with_nan_wait_is_refused(svc, cl, run_name):
    cid = cl.begin(run_name, world_size=2).checkpoint_id
    cl.put(cid, 0, shard_name(0), make_shard(0))
    before = snapshot(svc, run_name)
    try:
        with pytest.raises(grpc.RpcError) as info:
            cl.stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=0, files=[shard_name(0)],
                                                    wait_seconds=math.nan), timeout=1)
        assert info.value.code() == SC.INVALID_ARGUMENT, info.value.details()
        _unchanged(svc, before, run_name)
        # the refused vote did not count: rank 0 is still missing
        assert list(cl.vote(cid, 1, [], wait=0).missing_ranks) == [0]
    finally:
        cl.abort(cid, reason="end the test")  # ends the server-side loop either way


# ---------------------------------------------------------------- streams
@pytest.mark.parametrize("how", ["longer", "shorter"])
def test_stream_length_differs_from_declared(svc, cl, run_name, how):
    cid = cl.begin(run_name).checkpoint_id
    data = make_shard(0)
    before = snapshot(svc, run_name)
    for name in (shard_name(0), "opaque.bin"):  # with and without the safetensors check on the way
        if how == "longer":
            err = rpc_error(SC.INVALID_ARGUMENT, cl.put, cid, 0, name, data + b"12345678", size=len(data),
                            xxh3=hash_bytes(data))
            assert "longer" in err.details() and str(len(data)) in err.details()
        else:
            err = rpc_error(SC.INVALID_ARGUMENT, cl.put, cid, 0, name, data[:-8], size=len(data),
                            xxh3=hash_bytes(data))
            assert f"ended after {len(data) - 8} of the declared {len(data)}" in err.details()
    _unchanged(svc, before, run_name)
    # no shard was recorded: the correct upload of the same file is new, and commits
    res = cl.put(cid, 0, shard_name(0), data)
    assert res.already_present is False
    assert cl.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    assert cl.read(cid, 0, shard_name(0)) == data


def test_malformed_put_streams(svc, cl, run_name):
    cid = cl.begin(run_name).checkpoint_id
    data = make_shard(0)
    before = snapshot(svc, run_name)
    # no header at all, a chunk first, a second header mid-stream
    rpc_error(SC.INVALID_ARGUMENT, lambda: cl.stub.PutShard(iter([]), timeout=10))
    rpc_error(SC.INVALID_ARGUMENT, lambda: cl.stub.PutShard(iter([pb.PutShardRequest(chunk=data)]), timeout=10))
    hdr = pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=cid, rank=0, file_name=shard_name(0)))
    rpc_error(SC.INVALID_ARGUMENT, cl.put, cid, 0, shard_name(0), data, size=len(data) * 2, extra_messages=[hdr])
    # a declared hash that is not 32 lowercase hex digits; a negative size
    for bad in ("", "abc", hash_bytes(data).upper(), "z" * 32):
        rpc_error(SC.INVALID_ARGUMENT, cl.put, cid, 0, shard_name(0), data, xxh3=bad)
    rpc_error(SC.INVALID_ARGUMENT, cl.put, cid, 0, shard_name(0), b"", size=-1)
    _unchanged(svc, before, run_name)


def _raw_put(cl, messages):
    """PutShard with raw message bytes, as the lastgood client sends them (lastgood.wire.framing)."""
    call = cl.channel.stream_unary("/lastgood.v1.Checkpoints/PutShard", request_serializer=None,
                                   response_deserializer=pb.PutShardResponse.FromString)
    return call(iter(messages), timeout=10)


def test_put_messages_that_are_not_protobuf(svc, cl, run_name):
    """The service parses PutShard chunks by hand; bytes that are not a valid message are
    refused as INVALID_ARGUMENT (not an internal error) and change nothing. Control: the
    same stream with valid framings - hand-framed, a long varint, protobuf's own - commits."""
    cid = cl.begin(run_name).checkpoint_id
    data = make_shard(0)
    header = pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=cid, rank=0, file_name=shard_name(0),
                                                      size=len(data), xxh3_128=hash_bytes(data))).SerializeToString()
    a, b, c = data[:40], data[40:90], data[90:]
    framed = framing.frame(framing.PUT_CHUNK, a)
    before = snapshot(svc, run_name)
    for bad in ([b"\xff\x00garbage"], [header, framed[:-1]], [header, framed + b"\x00"], [header, b"\x0a\x05abc"]):
        err = rpc_error(SC.INVALID_ARGUMENT, _raw_put, cl, bad)
        assert "PutShard" in err.details() or "header" in err.details(), err.details()
    _unchanged(svc, before, run_name)

    overlong = bytes((framing.PUT_CHUNK, 0x80 | (len(b) & 0x7F), 0x80 | (len(b) >> 7), 0x00)) + b
    res = _raw_put(cl, [header, framed, overlong, pb.PutShardRequest(chunk=c).SerializeToString()])
    assert (res.already_present, res.size, res.xxh3_128) == (False, len(data), hash_bytes(data))
    assert cl.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    assert cl.read(cid, 0, shard_name(0)) == data  # GetShard's hand-framed replies parse as protobuf


# ---------------------------------------------------------------- names
@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", "x/../../etc/passwd", ".hidden", "a" * 201,
                                  "r\x00.bin", "r\n.bin", "caf\u00e9.bin"],
                         ids=["dotdot-slash", "slash", "dotdot", "empty", "traversal", "hidden", "too-long",
                              "nul", "newline", "non-ascii"])
def test_bad_file_names_on_put(svc, cl, run_name, name):
    cid = cl.begin(run_name).checkpoint_id
    before = snapshot(svc, run_name)
    err = rpc_error(SC.INVALID_ARGUMENT, cl.put, cid, 0, name, b"some bytes")
    assert "file name" in err.details()
    _unchanged(svc, before, run_name)


@pytest.mark.parametrize("name", ["%2E%2E", "..%2Fx", "a%2Fb", "%2E%2E%2F%2E%2E%2Fcatalog.db", "%2e%2e%2fx",
                                  "x%00y", "%20", ".hidden", "caf%C3%A9.bin", "a%5Cb"])
def test_bad_file_names_on_download(svc, committed, name):
    run, cid, _data = committed
    before = snapshot(svc, run)
    resp = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{name}")
    err = json_error(resp, (400, 404))
    assert resp.content != _data
    assert err["message"]
    _unchanged(svc, before, run)


@pytest.mark.slow
def test_declared_size_above_the_limit(make_service, run_name):
    small = make_service(LASTGOOD_MAX_SHARD_BYTES="1024")
    assert small.info["max_shard_bytes"] == 1024
    cl = Client(small.grpc_target)
    try:
        cid = cl.begin(run_name).checkpoint_id
        big = make_shard(0, n=400)
        assert len(big) > 1024
        before = snapshot(small, run_name)
        err = rpc_error(SC.RESOURCE_EXHAUSTED, cl.put, cid, 0, shard_name(0), big)
        assert "1024" in err.details()
        # refused on the declared size alone, before any byte is read: a huge declared size
        # with a handful of bytes gets the same answer
        rpc_error(SC.RESOURCE_EXHAUSTED, cl.put, cid, 0, shard_name(0), b"tiny", size=10**12)
        _unchanged(small, before, run_name)
        assert small.blob_root.joinpath("blobs").exists() and before["blobs"] == {}
        # CONTROL: a shard within the limit is accepted and commits
        ok = make_shard(0)
        assert len(ok) <= 1024
        assert cl.put(cid, 0, shard_name(0), ok).already_present is False
        assert cl.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    finally:
        cl.close()


def _bad_safetensors() -> dict[str, bytes]:
    good = make_shard(0)
    n = int.from_bytes(good[:8], "little")
    return {
        "text": b"this is not a safetensors file at all",
        "short": b"\x05\x00",
        "huge-header": (2**40).to_bytes(8, "little") + b"{}",
        "header-past-end": (500).to_bytes(8, "little") + b'{"a":1}',
        "not-json": (8).to_bytes(8, "little") + b"{{{{{{{{",
        "truncated-data": good[:-4],
        "bad-dtype": good[:8] + good[8:8 + n].replace(b'"F32"', b'"F99"') + good[8 + n:],
        "empty": b"",
    }


@pytest.mark.parametrize("case", list(_bad_safetensors()))
def test_invalid_safetensors_bytes(svc, cl, run_name, case):
    data = _bad_safetensors()[case]
    cid = cl.begin(run_name).checkpoint_id
    before = snapshot(svc, run_name)
    err = rpc_error(SC.INVALID_ARGUMENT, cl.put, cid, 0, shard_name(0), data)
    assert "safetensors" in err.details()
    _unchanged(svc, before, run_name)
    # CONTROL: the same bytes under a name that does not claim the format are just bytes
    assert cl.put(cid, 0, "opaque.bin", data).already_present is False


# ---------------------------------------------------------------- REST input
@pytest.mark.parametrize("path,status", [
    ("/api/v1/checkpoints/abc", 422),
    ("/api/v1/checkpoints/1.5", 422),
    ("/api/v1/checkpoints/0", 422),
    ("/api/v1/checkpoints/-3", 422),
    ("/api/v1/checkpoints/99999999999999999999999", 422),
    ("/api/v1/checkpoints/abc/manifest", 422),
    ("/api/v1/checkpoints/{cid}/ranks/x/files/rank00000.safetensors", 422),
    ("/api/v1/checkpoints/{cid}/ranks/-1/files/rank00000.safetensors", 422),
    ("/api/v1/checkpoints/{cid}/ranks/7/files/rank00000.safetensors", 400),
    ("/api/v1/runs?limit=0", 422),
    ("/api/v1/runs?limit=100000", 422),
    ("/api/v1/runs?limit=ten", 422),
    ("/api/v1/runs?offset=-1", 422),
    ("/api/v1/runs/{run}/checkpoints?limit=0", 422),
    ("/api/v1/runs/{run}/checkpoints?limit=100000", 422),
    ("/api/v1/runs/{run}/checkpoints?status=BOGUS", 400),
    ("/api/v1/runs/{run}/checkpoints?status=committed", 400),
    ("/api/v1/runs/{run}/events?limit=0", 422),
    ("/api/v1/runs/..evil", 400),
    ("/api/v1/runs/-dash", 400),
    ("/api/v1/runs/" + "r" * 200, 400),
    ("/api/v1/runs/bad%20name/checkpoints", 400),
    ("/api/v1/runs/caf%C3%A9/last-good", 400),
    ("/api/v1/runs/x%00y/events", 400),
])
def test_malformed_rest_input(svc, committed, path, status):
    run, cid, _ = committed
    before = snapshot(svc, run)
    err = json_error(http(svc).get(path.format(run=run, cid=cid)), status)
    assert err["code"] in ("invalid_request", "invalid_argument")
    _unchanged(svc, before, run)


def test_verify_a_pending_checkpoint_is_refused(svc, cl, run_name):
    cid = cl.begin(run_name).checkpoint_id
    before = snapshot(svc, run_name)
    err = json_error(http(svc).post(f"/api/v1/checkpoints/{cid}/verify"), 409)
    assert "PENDING" in err["message"]
    _unchanged(svc, before, run_name)


@pytest.mark.parametrize("rng", ["bytes=" + "9" * 5000 + "-", "bytes=0-" + "9" * 5000, "bytes=-" + "9" * 5000])
def test_range_with_absurdly_long_numbers(svc, committed, rng):
    run, cid, _ = committed
    # a one-off connection: the service drops a keep-alive connection after a 500
    resp = svc.get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}", headers={"Range": rng})
    json_error(resp, (400, 416))


def test_rest_error_messages_that_echo_input_are_bounded(svc, committed):
    """REST answers through the same bound as gRPC (api/errors.bounded)."""
    run, cid, _ = committed
    resp = svc.get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}",
                   headers={"Range": "bytes=" + "0-1," * 8000})
    err = json_error(resp, 400)
    assert err["message"].startswith("unsupported Range header") and len(err["message"]) < 1200, len(err["message"])
    assert err["message"].endswith(" more characters)")


# ---------------------------------------------------------------- BeginCheckpoint arguments
@pytest.mark.parametrize("run", ["", "a/b", "../x", "x" * 200, "..", "-x", "a b", "caf\u00e9", "a..b"])
def test_invalid_run_names_on_begin(svc, cl, run):
    before = snapshot(svc)
    err = rpc_error(SC.INVALID_ARGUMENT, cl.begin, run)
    assert "run name" in err.details()
    _unchanged(svc, before)


@pytest.mark.parametrize("kwargs,word", [
    ({"step": -1}, "step"),
    ({"world_size": 0}, "world size"),
    ({"world_size": -2}, "world size"),
    ({"world_size": 2**31 - 1}, "world size"),
    ({"world_size": 2, "rank": 2}, "rank"),
    ({"attempt": ""}, "attempt"),
    ({"attempt": "a/b"}, "attempt"),
])
def test_invalid_begin_arguments(svc, cl, run_name, kwargs, word):
    before = snapshot(svc, run_name)
    err = rpc_error(SC.INVALID_ARGUMENT, cl.begin, run_name, **kwargs)
    assert word in err.details()
    _unchanged(svc, before, run_name)
    assert before["runs"][run_name] is None  # no run was created on the way


def test_unknown_parent_creates_nothing(svc, cl, run_name, committed):
    other_run, other_cid, _ = committed
    before = snapshot(svc, run_name, other_run)
    rpc_error(SC.NOT_FOUND, cl.begin, run_name, parent_id=987654321)
    # a parent from another run is no parent of this one
    err = rpc_error(SC.NOT_FOUND, cl.begin, run_name, parent_id=other_cid)
    assert str(other_cid) in err.details()
    _unchanged(svc, before, run_name, other_run)
    assert before["runs"][run_name] is None


def test_client_vanishing_mid_stream_leaves_no_temp_file(svc, cl, run_name):
    cid = cl.begin(run_name).checkpoint_id
    data = make_shard(0, n=64)
    before = snapshot(svc, run_name)
    release = threading.Event()

    def messages():
        yield pb.PutShardRequest(header=pb.ShardHeader(checkpoint_id=cid, rank=0, file_name=shard_name(0),
                                                       size=len(data), xxh3_128=hash_bytes(data)))
        yield pb.PutShardRequest(chunk=data[:100])
        release.wait(10)  # the "client" hangs with the stream open until its deadline cancels the call

    try:
        with pytest.raises(grpc.RpcError) as info:
            cl.stub.PutShard(messages(), timeout=0.5)
        assert info.value.code() == SC.DEADLINE_EXCEEDED
    finally:
        release.set()
    # the service notices the cancellation asynchronously: poll (bounded) for its clean-up
    deadline = time.monotonic() + 10
    after = snapshot(svc, run_name)
    while after["tmp"] and time.monotonic() < deadline:
        time.sleep(0.05)
        after = snapshot(svc, run_name)
    assert_unchanged(before, after)
    # nothing was recorded: the whole file uploads afresh
    assert cl.put(cid, 0, shard_name(0), data).already_present is False
