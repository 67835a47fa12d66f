"""Fencing over the wire, against a real service process: once a newer launch of a run has
registered, the older launch's begin, put and vote are refused with FAILED_PRECONDITION
(trailing metadata lastgood-error: fenced) and its tags with HTTP 409 `fenced`, each
naming the newer launch; its pending checkpoint is abandoned; reads are not fenced."""

from __future__ import annotations

import grpc
import httpx
import pytest

from lastgood.wire.codes import ERROR_METADATA, FENCED, GENERATION_HEADER

from .helpers import Client, make_shard, shard_name


def register(svc, run: str, attempt: str, world_size: int = 1) -> int:
    r = svc.post(f"/api/v1/runs/{run}/launches", json={"attempt": attempt, "world_size": world_size})
    assert r.status_code == 200, r.text
    return r.json()["generation"]


def refused_as_fenced(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    e = info.value
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
    assert dict(e.trailing_metadata())[ERROR_METADATA] == FENCED
    assert "launch 'relaunch'" in e.details() and "generation 2" in e.details()
    return e


def test_an_older_launch_is_fenced_and_may_still_read(service, client: Client, run_name):
    old = register(service, run_name, "first")
    assert register(service, run_name, "first") == old == 1  # every rank registers: one generation
    cid = client.begin(run_name, 1, attempt="first", generation=old).checkpoint_id
    data = make_shard(0, seed=1)
    client.put(cid, 0, shard_name(0), data)
    assert client.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    kept = cid
    pending = client.begin(run_name, 2, parent_id=kept, attempt="first", generation=old).checkpoint_id

    assert register(service, run_name, "relaunch") == 2
    assert service.get(f"/api/v1/checkpoints/{pending}").json()["status"] == "ABANDONED"
    assert service.get(f"/api/v1/runs/{run_name}").json()["generation"] == 2
    current = service.get(f"/api/v1/runs/{run_name}/launches/current").json()
    assert current["attempt"] == "relaunch" and current["generation"] == 2

    refused_as_fenced(lambda: client.begin(run_name, 3, parent_id=kept, attempt="first", generation=old))
    refused_as_fenced(lambda: client.put(pending, 0, "rank00000.more", make_shard(0, seed=2)))
    refused_as_fenced(lambda: client.vote(pending, 0, [shard_name(0)]))
    r = service.post(f"/api/v1/checkpoints/{kept}/tags", json={"name": "zombie"},
                     headers={GENERATION_HEADER: str(old)})
    assert r.status_code == 409 and r.json()["error"]["code"] == FENCED and "relaunch" in r.json()["error"]["message"]
    r = httpx.put(f"{service.url}/api/v1/checkpoints/{kept}/pin", headers={GENERATION_HEADER: str(old)})
    assert r.status_code == 409 and r.json()["error"]["code"] == FENCED

    # reads are not fenced: the old launch (or anyone) still restores its checkpoint
    assert client.manifest(kept).step == 1
    assert client.read(kept, 0, shard_name(0)) == data
    assert service.get(f"/api/v1/runs/{run_name}/last-good").json()["id"] == kept
    # the new generation writes, and so does an operator's tag without a generation
    assert service.post(f"/api/v1/checkpoints/{kept}/tags", json={"name": "best"},
                        headers={GENERATION_HEADER: "2"}).status_code == 200
    assert service.post(f"/api/v1/checkpoints/{kept}/tags", json={"name": "by-hand"}).status_code == 200

    kinds = [e["kind"] for e in service.get(f"/api/v1/runs/{run_name}/events",
                                            params={"kind": "launch,fenced,fenced_write"}).json()["items"]]
    assert kinds == ["launch", "launch", "fenced", "fenced_write"]


def test_bad_registrations_are_refused_and_change_nothing(service, run_name):
    for body in ({"attempt": "no spaces allowed"}, {"attempt": "x" * 65}, {"attempt": "ok", "world_size": 0}, {}):
        r = service.post(f"/api/v1/runs/{run_name}/launches", json=body)
        assert r.status_code in (400, 422), (body, r.text)
    assert service.get(f"/api/v1/runs/{run_name}").status_code == 404
    r = service.post(f"/api/v1/checkpoints/1/tags", json={"name": "t"}, headers={GENERATION_HEADER: "-1"})
    assert r.status_code == 422


def test_a_fenced_launch_gets_no_peer_check_assignment(service, client: Client, run_name):
    """A zombie of a fenced launch is refused its assignment (on direct S3 it names presigned
    GETs of the store's objects) as it is refused its report."""
    old = register(service, run_name, "first")
    pending = client.begin(run_name, 1, attempt="first", generation=old).checkpoint_id
    assert service.get(f"/api/v1/checkpoints/{pending}/ranks/0/peer-check").status_code == 200  # control
    assert register(service, run_name, "relaunch") == 2
    for r in (service.get(f"/api/v1/checkpoints/{pending}/ranks/0/peer-check"),
              service.post(f"/api/v1/checkpoints/{pending}/ranks/0/peer-check", json={"peer_rank": 0, "files": []})):
        assert r.status_code == 409 and r.json()["error"]["code"] == FENCED, r.text
        assert "relaunch" in r.json()["error"]["message"]


def test_generation_0_is_refused_once_a_launch_registered(service, client: Client, run_name):
    """A zombie that drops its generation (sends 0, as a client that never registered does)
    is fenced like one that sends its old one; a pending generation-0 checkpoint begun
    before the first registration is abandoned by it and never commits."""
    other = f"{run_name}-unregistered"
    early = client.begin(run_name, 1, attempt="early").checkpoint_id  # generation 0, before any launch
    client.put(early, 0, shard_name(0), make_shard(0, seed=1))
    # control: a run no launch registered for takes generation 0 all the way to last-good
    cid = client.begin(other, 1, attempt="plain").checkpoint_id
    client.put(cid, 0, shard_name(0), make_shard(0, seed=1))
    assert client.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"

    assert register(service, run_name, "first") == 1
    assert register(service, run_name, "relaunch") == 2
    assert service.get(f"/api/v1/checkpoints/{early}").json()["status"] == "ABANDONED"
    e = refused_as_fenced(lambda: client.begin(run_name, 2, attempt="zombie", generation=0))
    assert "no generation (0)" in e.details()
    refused_as_fenced(lambda: client.vote(early, 0, [shard_name(0)]))
    # nothing of the refused begin was recorded; the registered launch still writes
    assert service.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"][0]["id"] == early
    cid = client.begin(run_name, 2, attempt="relaunch", generation=2).checkpoint_id
    client.put(cid, 0, shard_name(0), make_shard(0, seed=2))
    assert client.vote(cid, 0, [shard_name(0)], wait=2).status == "COMMITTED"
    assert service.get(f"/api/v1/runs/{run_name}/last-good").json()["id"] == cid
