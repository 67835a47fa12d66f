"""The manifest's root names every file's tensor index object by hash (docs/architecture.md,
"Checkpoint metadata"): the object is served checked, a tampered one is corruption like a
damaged shard (CORRUPT, last-good moves back), and verify re-hashes the objects too."""

from __future__ import annotations

import json

import pytest

from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import IndexMismatch, Manifest

from .helpers import (Client, checkpoint, events, http, index_blob, json_error, last_good_id, root_of, shard_blob,
                      shard_name)


def two_commits(svc, run: str) -> tuple[int, int]:
    with Client(svc.grpc_target) as c:
        first, _ = c.save(run, step=1)
        second, _ = c.save(run, step=2, parent_id=first)
    return first, second


def tamper(svc, cid: int) -> bytes:
    blob = index_blob(svc, cid, 0)
    good = blob.read_bytes()
    blob.write_bytes(good.replace(b'"data_start":', b'"data_start":1'))
    return good


@pytest.mark.slow
def test_the_root_references_each_index_object_by_hash(make_service, run_name):
    svc = make_service()
    h = http(svc)
    _, cid = two_commits(svc, run_name)
    raw = h.get(f"/api/v1/checkpoints/{cid}/manifest").content
    root = Manifest.from_bytes(raw)
    (entry,) = root.files(0)
    assert root.version == 2 and entry.tensors is None and b'"tensors":{' not in raw
    assert entry.size == shard_blob(svc, cid, 0).stat().st_size
    body = h.get(f"/api/v1/checkpoints/{cid}/ranks/0/index/{shard_name(0)}").content
    assert entry.index == {"xxh3_128": hash_bytes(body), "size": len(body), "tensors": len(entry.with_index(0, body).tensors)}
    full = h.get(f"/api/v1/checkpoints/{cid}").json()["manifest"]  # the full view, built on demand
    assert root_of(full) == json.loads(raw) and full["ranks"][0]["files"][0]["tensors"] == json.loads(body)["tensors"]
    # the reader checks the object against the root too
    with pytest.raises(IndexMismatch):
        entry.with_index(0, body.replace(b'"data_start":', b'"data_start":1'))
    with pytest.raises(IndexMismatch):  # the right object of another rank
        entry.with_index(1, body)


@pytest.mark.parametrize("found_by", ["read", "verify"])
@pytest.mark.slow
def test_a_tampered_index_object_is_corruption(make_service, run_name, found_by):
    svc = make_service()
    h = http(svc)
    first, second = two_commits(svc, run_name)
    url = f"/api/v1/checkpoints/{second}/ranks/0/index/{shard_name(0)}"
    assert h.get(url).status_code == 200  # control: intact, served
    assert h.post(f"/api/v1/checkpoints/{second}/verify").json()["ok"] is True
    good = tamper(svc, second)
    if found_by == "read":
        assert json_error(h.get(url), 422)["code"] == "hash_mismatch"
    else:
        res = h.post(f"/api/v1/checkpoints/{second}/verify").json()
        assert res["ok"] is False
        assert res["bad"] == [{"rank": 0, "file": f"{shard_name(0)} (tensor index)", "expected": hash_bytes(good),
                               "found": hash_bytes(index_blob(svc, second, 0).read_bytes())}]
    assert checkpoint(svc, second)["status"] == "CORRUPT"
    assert last_good_id(svc, run_name) == first
    assert [e["checkpoint_id"] for e in events(svc, run_name) if e["kind"] == "corrupt"] == [second]
    json_error(h.get(url), 409)  # nothing of a corrupt checkpoint is served


@pytest.mark.slow
def test_index_of_a_file_without_one_and_bad_names_are_refused(make_service, run_name):
    svc = make_service()
    h = http(svc)
    _, cid = two_commits(svc, run_name)
    json_error(h.get(f"/api/v1/checkpoints/{cid}/ranks/0/index/nope.safetensors"), 404)
    json_error(h.get(f"/api/v1/checkpoints/{cid}/ranks/0/index/..%2Fx"), (400, 404))
    json_error(h.get(f"/api/v1/checkpoints/{cid}/ranks/5/index/{shard_name(0)}"), 400)
    assert checkpoint(svc, cid)["status"] == "COMMITTED"


@pytest.mark.parametrize("damage", ["removed", "changed"])
@pytest.mark.slow
def test_the_view_of_a_checkpoint_whose_index_is_damaged_shows_it_corrupt(make_service, run_name, damage):
    """`GET /checkpoints/{id}` builds the full view from the index objects; a damaged one
    marks the checkpoint CORRUPT (as any read does), and the view then shows the checkpoint
    as it now is, with no manifest: the checkpoint exists, so never a 404 or a 5xx."""
    svc = make_service()
    h = http(svc)
    first, second = two_commits(svc, run_name)
    assert h.get(f"/api/v1/checkpoints/{second}").json()["manifest"] is not None  # control: intact
    if damage == "removed":
        blob = index_blob(svc, second, 0)
        blob.chmod(0o644)
        blob.unlink()
    else:
        tamper(svc, second)
    r = h.get(f"/api/v1/checkpoints/{second}")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "CORRUPT" and r.json()["manifest"] is None
    assert last_good_id(svc, run_name) == first
