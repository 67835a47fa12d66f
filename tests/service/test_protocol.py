"""The two-phase commit over gRPC against a real service: begin, put, vote, commit, abort, expiry."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import numpy as np
from safetensors.numpy import load as st_load

from lastgood.wire.hashing import hash_bytes

from .helpers import (ATTEMPT, checkpoint, ckpt_dir, events, http, json_error, last_good_id, make_shard, root_of,
                      rpc_error, shard_blob, shard_name, snapshot, wait_status)

SC = grpc.StatusCode


def _download(service, cid: int, rank: int, name: str):
    return http(service).get(f"/api/v1/checkpoints/{cid}/ranks/{rank}/files/{name}")


def test_two_ranks_commit_only_after_both_votes(service, client, run_name):
    b0 = client.begin(run_name, step=10, world_size=2, rank=0)
    b1 = client.begin(run_name, step=10, world_size=2, rank=1)
    assert b0.checkpoint_id > 0 and b1.checkpoint_id == b0.checkpoint_id, "begin is idempotent on (run, step, attempt)"
    assert b0.status == b1.status == "PENDING"
    assert b0.lease_seconds == 3.0
    cid = b0.checkpoint_id

    shards = {r: make_shard(r, seed=10) for r in (0, 1)}
    assert shards[0] != shards[1]
    for r, data in shards.items():
        res = client.put(cid, r, shard_name(r), data)
        assert (res.already_present, res.size, res.xxh3_128) == (False, len(data), hash_bytes(data))

    v0 = client.vote(cid, 0, [shard_name(0)], wait=0)
    assert v0.checkpoint_id == cid and v0.status == "PENDING" and list(v0.missing_ranks) == [1]

    # nothing is visible while rank 1 has not voted
    view = checkpoint(service, cid)
    assert view["status"] == "PENDING" and view["manifest"] is None and view["last_good"] is False
    assert view["world_size"] == 2 and view["step"] == 10 and view["run"] == run_name
    assert json_error(http(service).get(f"/api/v1/runs/{run_name}/last-good"), 404)["code"] == "no_checkpoint"
    assert json_error(_download(service, cid, 0, shard_name(0)), 409)["code"] == "failed_precondition"
    json_error(http(service).get(f"/api/v1/checkpoints/{cid}/manifest"), 409)
    rpc_error(SC.FAILED_PRECONDITION, client.manifest, cid)
    rpc_error(SC.FAILED_PRECONDITION, client.read, cid, 0, shard_name(0))
    rpc_error(SC.NOT_FOUND, client.manifest, 0, run_name)  # the run has no last-good yet

    v1 = client.vote(cid, 1, [shard_name(1)], wait=2)
    assert v1.status == "COMMITTED" and list(v1.missing_ranks) == []
    again = client.vote(cid, 0, [shard_name(0)], wait=0)  # a repeated vote just reports the outcome
    assert again.status == "COMMITTED"

    lg = http(service).get(f"/api/v1/runs/{run_name}/last-good")
    assert lg.status_code == 200 and lg.json()["id"] == cid and lg.json()["last_good"] is True
    view = checkpoint(service, cid)
    assert view["status"] == "COMMITTED" and view["committed_at"] and view["last_good"] is True
    assert view["bytes"] == len(shards[0]) + len(shards[1])
    m = view["manifest"]
    assert "manifest" not in lg.json()  # last-good answers without its manifest unless asked
    root = http(service).get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"}).json()["manifest"]
    assert root == root_of(m) and root["format"] == "lastgood.manifest/2"
    assert (m["checkpoint_id"], m["run"], m["step"], m["world_size"], m["attempt"], m["parent_id"]) == \
        (cid, run_name, 10, 2, ATTEMPT, None)
    assert [r["rank"] for r in m["ranks"]] == [0, 1]
    for entry in m["ranks"]:
        data = shards[entry["rank"]]
        (f,) = entry["files"]
        assert (f["name"], f["size"], f["xxh3_128"]) == (shard_name(entry["rank"]), len(data), hash_bytes(data))
        # the tensor index locates every tensor's bytes inside the file
        arrays = st_load(data)
        assert set(f["tensors"]) == set(arrays)
        for name, t in f["tensors"].items():
            a, b = t["offsets"]
            assert t["shape"] == list(arrays[name].shape)
            assert data[f["data_start"] + a:f["data_start"] + b] == arrays[name].tobytes()
        assert {t["dtype"] for t in f["tensors"].values()} == {"F32", "I64", "U8"}

    # the same manifest bytes over REST and gRPC; the same file bytes over REST and gRPC
    rest_manifest = http(service).get(f"/api/v1/checkpoints/{cid}/manifest")
    assert rest_manifest.status_code == 200
    grpc_manifest = client.manifest(cid)
    assert grpc_manifest.manifest == rest_manifest.content and grpc_manifest.step == 10
    assert json.loads(grpc_manifest.manifest) == root_of(m)
    assert client.manifest(0, run_name).checkpoint_id == cid
    for r, data in shards.items():
        got = _download(service, cid, r, shard_name(r))
        assert got.status_code == 200 and got.content == data
        assert client.read(cid, r, shard_name(r)) == data
        np.testing.assert_array_equal(st_load(got.content)["train.step"], np.array([10, r]))

    kinds = [e["kind"] for e in events(service, run_name) if e["checkpoint_id"] == cid]
    assert kinds.count("begin") == 1 and kinds.count("commit") == 1


def test_a_waiting_vote_hears_the_commit(service, client, run_name):
    """Rank 0 votes with wait_seconds and blocks until the checkpoint commits; its call is
    answered COMMITTED (not PENDING) without voting again. Which vote's call runs the commit
    is a race: a re-vote of rank 1 may find every vote in while rank 0's call is committing
    (PENDING with nobody missing)."""
    cid = client.begin(run_name, step=1, world_size=2).checkpoint_id
    for r in (0, 1):
        client.put(cid, r, shard_name(r), make_shard(r))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.vote, cid, 0, [shard_name(0)], 10.0)  # capped by the service at 2 s
        # rank 1 votes (repeating an identical vote is harmless) until the checkpoint commits
        deadline = time.monotonic() + 10
        res1 = client.vote(cid, 1, [shard_name(1)], wait=0)
        while res1.status != "COMMITTED" and time.monotonic() < deadline:
            assert res1.status == "PENDING" and list(res1.missing_ranks) in ([0], [])  # never rank 1
            time.sleep(0.02)
            res1 = client.vote(cid, 1, [shard_name(1)], wait=0)
        res0 = waiting.result(timeout=30)
    assert res1.status == "COMMITTED"
    assert res0.status == "COMMITTED" and list(res0.missing_ranks) == []
    assert last_good_id(service, run_name) == cid


def test_resending_identical_shard_is_a_no_op(service, client, run_name):
    cid = client.begin(run_name, step=1).checkpoint_id
    data = make_shard(0, seed=3)
    assert client.put(cid, 0, shard_name(0), data).already_present is False
    # before the commit, too, an identical re-send writes nothing
    before = snapshot(service, run_name)
    res = client.put(cid, 0, shard_name(0), data)
    assert (res.already_present, res.size, res.xxh3_128) == (True, len(data), hash_bytes(data))
    assert snapshot(service, run_name) == before
    assert client.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"

    before = snapshot(service, run_name)
    manifest = http(service).get(f"/api/v1/checkpoints/{cid}/manifest").content
    n_events = len(events(service, run_name))
    blob = shard_blob(service, cid, 0)
    mtime = blob.stat().st_mtime_ns

    res = client.put(cid, 0, shard_name(0), data)
    assert (res.already_present, res.size, res.xxh3_128) == (True, len(data), hash_bytes(data))

    assert snapshot(service, run_name) == before
    assert http(service).get(f"/api/v1/checkpoints/{cid}/manifest").content == manifest
    assert len(events(service, run_name)) == n_events
    assert blob.stat().st_mtime_ns == mtime and blob.read_bytes() == data
    assert checkpoint(service, cid)["status"] == "COMMITTED"


def test_child_checkpoint_records_parent_and_moves_last_good(service, client, run_name):
    first, _ = client.save(run_name, step=100)
    assert last_good_id(service, run_name) == first

    second = client.begin(run_name, step=200, parent_id=first).checkpoint_id
    assert second != first
    data = make_shard(0, seed=200)
    client.put(second, 0, shard_name(0), data)
    assert last_good_id(service, run_name) == first  # not before the vote
    assert client.vote(second, 0, [shard_name(0)], wait=2).status == "COMMITTED"

    assert last_good_id(service, run_name) == second
    view = checkpoint(service, second)
    assert view["parent_id"] == first and view["manifest"]["parent_id"] == first
    assert checkpoint(service, first)["last_good"] is False
    assert checkpoint(service, first)["status"] == "COMMITTED"
    assert client.manifest(0, run_name).checkpoint_id == second
    # a parent that is not in this run is refused
    rpc_error(SC.NOT_FOUND, client.begin, run_name, step=300, parent_id=10**9)


def test_hash_mismatch_is_rejected_and_never_commits(service, client, run_name):
    cid = client.begin(run_name, step=5, world_size=2).checkpoint_id
    good1 = make_shard(1, seed=5)
    client.put(cid, 1, shard_name(1), good1)
    assert list(client.vote(cid, 1, [shard_name(1)]).missing_ranks) == [0]

    data = make_shard(0, seed=5)
    wrong = hash_bytes(data + b"x")
    assert wrong != hash_bytes(data)
    err = rpc_error(SC.DATA_LOSS, client.put, cid, 0, shard_name(0), data, xxh3=wrong)
    assert wrong in err.details() and hash_bytes(data) in err.details()

    # the rejected shard is not recorded: a vote that lists it is refused, again and again
    for _ in range(2):
        err = rpc_error(SC.FAILED_PRECONDITION, client.vote, cid, 0, [shard_name(0)], wait=0)
        assert shard_name(0) in err.details()
    res = client.vote(cid, 1, [shard_name(1)])
    assert res.status == "PENDING" and list(res.missing_ranks) == [0]
    view = checkpoint(service, cid)
    assert view["status"] == "PENDING" and view["manifest"] is None
    assert last_good_id(service, run_name) is None
    assert not (ckpt_dir(service, cid) / "r0").exists()
    assert list((service.blob_root / "tmp").iterdir()) == []

    mismatches = [e for e in events(service, run_name) if e["kind"] == "hash_mismatch"]
    assert len(mismatches) == 1
    assert mismatches[0]["checkpoint_id"] == cid
    assert mismatches[0]["data"]["declared"] == wrong and mismatches[0]["data"]["received"] == hash_bytes(data)
    assert mismatches[0]["data"]["file"] == shard_name(0) and mismatches[0]["data"]["rank"] == 0

    # CONTROL: the very same bytes with their true hash are accepted, and the checkpoint commits
    res = client.put(cid, 0, shard_name(0), data)
    assert res.already_present is False and res.xxh3_128 == hash_bytes(data)
    assert client.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    assert last_good_id(service, run_name) == cid
    assert client.read(cid, 0, shard_name(0)) == data


@pytest.mark.slow
def test_lease_expiry_abandons_and_keeps_last_good(service, client, run_name):
    # CONTROL: both ranks vote -> committed (and it stays committed while the reaper runs)
    good, _ = client.save(run_name, step=1, world_size=2)
    assert last_good_id(service, run_name) == good

    cid = client.begin(run_name, step=2, world_size=2).checkpoint_id
    for r in (0, 1):
        client.put(cid, r, shard_name(r), make_shard(r, seed=2))
    assert client.vote(cid, 0, [shard_name(0)], wait=0).status == "PENDING"
    # rank 1 "dies": nothing more arrives; the 3 s lease runs out
    view = wait_status(service, cid, "ABANDONED", timeout=15)
    assert view["manifest"] is None and view["last_good"] is False

    expired = [e for e in events(service, run_name) if e["kind"] == "expired"]
    assert [e["checkpoint_id"] for e in expired] == [cid]
    assert expired[0]["data"]["voted_ranks"] == [0]
    assert last_good_id(service, run_name) == good
    assert checkpoint(service, good)["status"] == "COMMITTED"

    # a late vote and a re-begin under the same attempt are refused; nothing becomes visible
    err = rpc_error(SC.FAILED_PRECONDITION, client.vote, cid, 1, [shard_name(1)], wait=0)
    assert "ABANDONED" in err.details()
    rpc_error(SC.FAILED_PRECONDITION, client.begin, run_name, step=2, world_size=2)
    assert checkpoint(service, cid)["status"] == "ABANDONED"
    json_error(http(service).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}"), 409)
    # a new attempt of the same step is a new checkpoint
    retry = client.begin(run_name, step=2, world_size=2, attempt="attempt-2").checkpoint_id
    assert retry != cid


def test_abort(service, client, run_name):
    committed, _ = client.save(run_name, step=1)

    cid = client.begin(run_name, step=2).checkpoint_id
    client.put(cid, 0, shard_name(0), make_shard(0, seed=2))
    assert client.abort(cid, reason="loss spike", rank=0).status == "ABANDONED"
    view = checkpoint(service, cid)
    assert view["status"] == "ABANDONED" and view["manifest"] is None
    aborts = [e for e in events(service, run_name) if e["kind"] == "abort"]
    assert [e["checkpoint_id"] for e in aborts] == [cid] and aborts[0]["data"]["reason"] == "loss spike"
    assert client.abort(cid).status == "ABANDONED"  # idempotent
    rpc_error(SC.FAILED_PRECONDITION, client.vote, cid, 0, [shard_name(0)])
    rpc_error(SC.FAILED_PRECONDITION, client.put, cid, 0, "other.bin", b"late bytes")
    assert last_good_id(service, run_name) == committed

    # a committed checkpoint cannot be aborted
    err = rpc_error(SC.FAILED_PRECONDITION, client.abort, committed)
    assert "COMMITTED" in err.details()
    view = checkpoint(service, committed)
    assert view["status"] == "COMMITTED" and view["last_good"] is True
    assert last_good_id(service, run_name) == committed
