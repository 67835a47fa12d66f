"""REST reads of committed checkpoints: listings, views, manifest, ranged downloads, verify, corruption."""

from __future__ import annotations

import json

import grpc
import pytest

from lastgood.wire.hashing import hash_bytes

from .helpers import (Client, checkpoint, ckpt_dir, events, http, json_error, last_good_id, make_shard, root_of,
                      rpc_error, shard_blob, shard_name)


@pytest.fixture(scope="module")
def history(service):
    """A run with two committed checkpoints (steps 10 and 20, world size 2, larger shards)
    and one abandoned one (step 30): (run, [id10, id20], id30, {id: {rank: bytes}})."""
    run = "rest-history"
    c = Client(service.grpc_target)
    try:
        ids, data = [], {}
        for step in (10, 20):
            cid = c.begin(run, step=step, world_size=2, parent_id=ids[-1] if ids else 0).checkpoint_id
            data[cid] = {r: make_shard(r, seed=step, n=64) for r in (0, 1)}
            for r, b in data[cid].items():
                c.put(cid, r, shard_name(r), b)
            c.vote(cid, 0, [shard_name(0)])
            assert c.vote(cid, 1, [shard_name(1)], wait=2).status == "COMMITTED"
            ids.append(cid)
        abandoned = c.begin(run, step=30).checkpoint_id
        c.abort(abandoned, reason="rest test")
    finally:
        c.close()
    return run, ids, abandoned, data


def test_health_info_and_docs(service):
    h = http(service)
    r = h.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    info = h.get("/api/v1/info").json()
    assert info["service"] == "lastgood" and info["grpc_target"] == service.grpc_target
    host, port = info["grpc_target"].rsplit(":", 1)
    assert host and int(port) > 0
    assert info["lease_seconds"] == 3.0 and info["max_chunk_bytes"] > 0 and info["max_shard_bytes"] > 0
    spec = h.get("/openapi.json")
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    for p in ("/api/v1/runs", "/api/v1/runs/{run}/last-good", "/api/v1/checkpoints/{checkpoint_id}/verify",
              "/api/v1/checkpoints/{checkpoint_id}/ranks/{rank}/files/{file_name}"):
        assert p in paths
    for page in ("/docs", "/redoc"):  # they would load Swagger UI / ReDoc from a CDN: off (docs/security.md)
        json_error(h.get(page), 404)
    json_error(h.get("/api/v1/no-such-route"), 404)


def test_list_runs_paginated(service, history):
    h = http(service)
    c = Client(service.grpc_target)
    try:
        mine = [f"rest-page-{i}" for i in range(3)]
        for name in mine:
            c.save(name, step=1)
    finally:
        c.close()
    full = h.get("/api/v1/runs", params={"limit": 1000}).json()
    assert full["limit"] == 1000 and full["offset"] == 0
    names = [r["name"] for r in full["items"]]
    assert full["total"] == len(names) >= 4 and names == sorted(names)
    assert set(mine) | {history[0]} <= set(names)

    walked = []
    for offset in range(0, full["total"], 2):
        page = h.get("/api/v1/runs", params={"limit": 2, "offset": offset}).json()
        assert page["total"] == full["total"] and page["limit"] == 2 and page["offset"] == offset
        assert 1 <= len(page["items"]) <= 2
        walked += [r["name"] for r in page["items"]]
    assert walked == names
    past = h.get("/api/v1/runs", params={"limit": 5, "offset": full["total"]}).json()
    assert past["items"] == [] and past["total"] == full["total"]

    one = next(r for r in full["items"] if r["name"] == "rest-page-0")
    assert one["checkpoints"]["COMMITTED"] == 1 and one["last_good"]["step"] == 1


def test_run_and_checkpoint_listing(service, history):
    run, (c10, c20), abandoned, _ = history
    h = http(service)
    view = h.get(f"/api/v1/runs/{run}").json()
    assert view["name"] == run and view["created_at"]
    assert view["checkpoints"] == {"PENDING": 0, "COMMITTED": 2, "ABANDONED": 1, "CORRUPT": 0, "DELETED": 0}
    assert view["last_good"]["id"] == c20 and view["last_good"]["step"] == 20

    all_ = h.get(f"/api/v1/runs/{run}/checkpoints").json()
    assert [c["id"] for c in all_["items"]] == [abandoned, c20, c10] and all_["total"] == 3  # newest step first
    assert [c["status"] for c in all_["items"]] == ["ABANDONED", "COMMITTED", "COMMITTED"]

    page = h.get(f"/api/v1/runs/{run}/checkpoints", params={"status": "COMMITTED", "limit": 1, "offset": 1}).json()
    assert page["total"] == 2 and page["limit"] == 1 and page["offset"] == 1
    (item,) = page["items"]
    assert (item["id"], item["step"], item["status"], item["last_good"]) == (c10, 10, "COMMITTED", False)
    assert item["world_size"] == 2 and item["parent_id"] is None and item["lease_expires_at"] is None

    abandoned_only = h.get(f"/api/v1/runs/{run}/checkpoints", params={"status": "ABANDONED"}).json()
    assert [c["id"] for c in abandoned_only["items"]] == [abandoned]


def test_checkpoint_view_and_manifest(service, history):
    run, (c10, c20), abandoned, data = history
    h = http(service)
    view = h.get(f"/api/v1/checkpoints/{c20}").json()
    assert (view["id"], view["run"], view["step"], view["status"], view["parent_id"], view["last_good"]) == \
        (c20, run, 20, "COMMITTED", c10, True)
    assert view["bytes"] == sum(len(b) for b in data[c20].values())
    m = view["manifest"]
    raw = h.get(f"/api/v1/checkpoints/{c20}/manifest")
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("application/json")
    assert json.loads(raw.content) == root_of(m)  # the root; the view adds every file's tensors
    assert m["checkpoint_id"] == c20 and m["parent_id"] == c10 and m["step"] == 20
    for entry in m["ranks"]:
        (f,) = entry["files"]
        b = data[c20][entry["rank"]]
        assert (f["name"], f["size"], f["xxh3_128"]) == (shard_name(entry["rank"]), len(b), hash_bytes(b))
    assert h.get(f"/api/v1/checkpoints/{abandoned}").json()["manifest"] is None
    json_error(h.get(f"/api/v1/checkpoints/{abandoned}/manifest"), 409)
    lg = h.get(f"/api/v1/runs/{run}/last-good").json()
    assert lg["id"] == c20 and "manifest" not in lg
    lg = h.get(f"/api/v1/runs/{run}/last-good", params={"manifest": "true"}).json()
    assert lg["manifest"] == root_of(m)


def test_download_whole_and_ranges(service, history):
    _run, (_c10, c20), _abandoned, data = history
    h = http(service)
    b = data[c20][1]
    size = len(b)
    assert size > 200
    url = f"/api/v1/checkpoints/{c20}/ranks/1/files/{shard_name(1)}"

    r = h.get(url)
    assert r.status_code == 200 and r.content == b
    assert r.headers["content-length"] == str(size)
    assert r.headers["x-lastgood-xxh3-128"] == hash_bytes(b)
    assert r.headers["accept-ranges"] == "bytes"
    assert shard_name(1) in r.headers["content-disposition"]

    for rng, start, end in (("bytes=0-9", 0, 10), ("bytes=10-", 10, size), ("bytes=-5", size - 5, size),
                            (f"bytes=5-{size + 100}", 5, size), (f"bytes=-{size + 7}", 0, size),
                            (f"bytes={size - 1}-{size - 1}", size - 1, size)):
        r = h.get(url, headers={"Range": rng})
        assert r.status_code == 206, (rng, r.text)
        assert r.content == b[start:end], rng
        assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{size}", rng
        assert r.headers["content-length"] == str(end - start), rng

    for rng in (f"bytes={size}-", f"bytes={size + 10}-{size + 20}", "bytes=-0"):
        r = h.get(url, headers={"Range": rng})
        err = json_error(r, 416)
        assert err["code"] == "out_of_range"
        assert r.headers["content-range"] == f"bytes */{size}", rng

    for rng in ("bytes=abc", "bytes=5-2", "bytes=0-1,3-4", "items=0-1", "bytes=-", "bytes=1.5-2", ""):
        json_error(h.get(url, headers={"Range": rng}), 400)

    json_error(h.get(f"/api/v1/checkpoints/{c20}/ranks/1/files/nope.safetensors"), 404)
    json_error(h.get(f"/api/v1/checkpoints/{c20}/ranks/0/files/{shard_name(1)}"), 404)


def test_verify_intact(service, history):
    run, (c10, c20), _abandoned, _ = history
    res = http(service).post(f"/api/v1/checkpoints/{c20}/verify")
    assert res.status_code == 200
    body = res.json()
    assert body == {"checkpoint_id": c20, "ok": True, "files": 2, "bad": [], "status": "COMMITTED"}
    assert last_good_id(service, run) == c20
    assert not [e for e in events(service, run) if e["kind"] == "corrupt"]


@pytest.mark.slow
def test_corruption_found_by_verify_moves_last_good_back(make_service, run_name):
    svc = make_service()
    h = http(svc)
    c = Client(svc.grpc_target)
    try:
        first, _ = c.save(run_name, step=1)
        second, shards = c.save(run_name, step=2, parent_id=first)
    finally:
        c.close()
    assert last_good_id(svc, run_name) == second
    assert h.post(f"/api/v1/checkpoints/{second}/verify").json()["ok"] is True

    # flip one byte inside the tensor data of the stored blob
    blob = shard_blob(svc, second, 0)
    raw = bytearray(blob.read_bytes())
    assert raw == shards[0]
    raw[-3] ^= 0xFF
    blob.write_bytes(bytes(raw))

    res = h.post(f"/api/v1/checkpoints/{second}/verify")
    assert res.status_code == 200
    body = res.json()
    assert body["ok"] is False and body["status"] == "CORRUPT" and body["files"] == 1
    (bad,) = body["bad"]
    assert (bad["rank"], bad["file"], bad["expected"]) == (0, shard_name(0), hash_bytes(shards[0]))
    assert bad["found"] == hash_bytes(bytes(raw))

    assert last_good_id(svc, run_name) == first
    view = checkpoint(svc, second)
    assert view["status"] == "CORRUPT" and view["manifest"] is None and view["last_good"] is False
    assert checkpoint(svc, first)["last_good"] is True
    corrupt = [e for e in events(svc, run_name) if e["kind"] == "corrupt"]
    assert [e["checkpoint_id"] for e in corrupt] == [second]
    assert corrupt[0]["data"]["last_good"] == first
    # nothing of the corrupt checkpoint is served any more
    json_error(h.get(f"/api/v1/checkpoints/{second}/ranks/0/files/{shard_name(0)}"), 409)
    json_error(h.get(f"/api/v1/checkpoints/{second}/manifest"), 409)
    assert h.get(f"/api/v1/runs/{run_name}/checkpoints", params={"status": "CORRUPT"}).json()["total"] == 1
    # verifying again reports it again, without a second event; the good one is still intact
    again = h.post(f"/api/v1/checkpoints/{second}/verify").json()
    assert again["ok"] is False and again["status"] == "CORRUPT"
    assert len([e for e in events(svc, run_name) if e["kind"] == "corrupt"]) == 1
    assert h.post(f"/api/v1/checkpoints/{first}/verify").json()["ok"] is True
    assert last_good_id(svc, run_name) == first


    # a blob that is gone altogether is corruption too; with no good checkpoint left, no
    # last-good, and the answer says so: not "no checkpoint", which would start a job over
    shard_blob(svc, first, 0).unlink()
    body = h.post(f"/api/v1/checkpoints/{first}/verify").json()
    assert body["ok"] is False and body["status"] == "CORRUPT" and body["bad"][0]["found"] == "missing"
    err = json_error(h.get(f"/api/v1/runs/{run_name}/last-good"), 409)
    assert err["code"] == "no_usable_checkpoint" and f"[{second}, {first}]" in err["message"]


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_manifest_of_last_good_answers_its_parent(service, client, run_name, damage):
    """Reading last-good finds its manifest damaged: that checkpoint becomes CORRUPT and
    the answer, on REST and gRPC alike, is the newest good ancestor, never an error (which
    a client could only give up on) and never "no checkpoint" (which starts a job over)."""
    first, _ = client.save(run_name, step=1)
    second, _ = client.save(run_name, step=2, parent_id=first)
    third, _ = client.save(run_name, step=3, parent_id=second)
    for cid in (third, second):  # the first fallback is damaged too
        path = ckpt_dir(service, cid) / "manifest.json"
        if damage == "delete":
            path.unlink()
        else:
            raw = bytearray(path.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            path.write_bytes(bytes(raw))

    lg = http(service).get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"})
    assert lg.status_code == 200, lg.text
    assert lg.json()["id"] == first and lg.json()["manifest"]["checkpoint_id"] == first
    assert [checkpoint(service, c)["status"] for c in (first, second, third)] == ["COMMITTED", "CORRUPT", "CORRUPT"]
    assert client.manifest(0, run_name).checkpoint_id == first
    assert http(service).get(f"/api/v1/checkpoints/{third}/ancestors").json()["fallback_id"] == first

    # the last good one damaged as well: a refusal that says why, on REST and gRPC
    (ckpt_dir(service, first) / "manifest.json").unlink()
    err = json_error(http(service).get(f"/api/v1/runs/{run_name}/last-good"), 409)
    assert err["code"] == "no_usable_checkpoint"
    rpc_error(grpc.StatusCode.FAILED_PRECONDITION, client.manifest, 0, run_name)
    assert http(service).get(f"/api/v1/checkpoints/{third}/ancestors").json()["fallback_id"] is None


@pytest.mark.slow
def test_download_of_a_vanished_blob_is_a_json_error(make_service, run_name):
    svc = make_service()
    c = Client(svc.grpc_target)
    try:
        cid, _ = c.save(run_name, step=1)
        shard_blob(svc, cid, 0).unlink()  # storage lost the file; nobody ran verify yet
        with pytest.raises(grpc.RpcError) as info:
            c.read(cid, 0, shard_name(0))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "missing" in info.value.details()
    finally:
        c.close()
    # REST must say the same thing, as JSON (a fresh connection: the service drops one after a 500)
    err = json_error(svc.get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}"), 404)
    assert "missing" in err["message"]
