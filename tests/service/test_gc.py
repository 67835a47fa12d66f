"""Retention policies and garbage collection: plan() is a free dry run, execute(plan)
never deletes more than its plan and re-checks each deletion; GC never deletes what a
kept manifest, a tag, a pin or a lease still needs (I4)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import lastgood
from lastgood_service.domain.runs.retention import Retention, RunView

from .helpers import Client, blob_files, checkpoint, ckpt_dir, http, json_error, last_good_id

GC_ENV = {"LASTGOOD_RETENTION": "latest:1,tagged,last-good,branch-heads", "LASTGOOD_GC_INTERVAL": "0",
          "LASTGOOD_GC_GRACE_SECONDS": "0"}


# ---------------------------------------------------------------- policies
def test_policies_compose():
    run = RunView(last_good_id=5, committed=[(1, 0), (2, 100), (3, 150), (4, 200), (5, 250)],
                  tags={2: {"best"}, 3: {"suspect"}}, branch_heads={5, 3})
    assert Retention.parse("latest:2,last-good,branch-heads").keep(run) == {4, 5, 3}
    assert Retention.parse("every:100,last-good,branch-heads").keep(run) == {1, 2, 4, 5, 3}
    assert Retention.parse("tagged,last-good,branch-heads").keep(run) == {2, 5, 3}  # suspect alone keeps nothing
    assert Retention.parse("latest:0,last-good,branch-heads").keep(run) == {5, 3}


@pytest.mark.parametrize("spec", ["latest:2", "latest,last-good,branch-heads", "every:0,last-good,branch-heads",
                                  "forever,last-good,branch-heads", "latest:x,last-good,branch-heads"])
def test_bad_retention_specs_are_refused(spec):
    with pytest.raises(ValueError):
        Retention.parse(spec)


@pytest.mark.slow
def test_a_bad_retention_setting_stops_the_service_with_the_reason(make_service):
    with pytest.raises(RuntimeError, match="retention"):
        make_service(LASTGOOD_RETENTION="latest:2")


# ---------------------------------------------------------------- plan / execute through REST
def _chain(c: Client, run: str, steps) -> list[int]:
    ids, parent = [], 0
    for step in steps:
        cid, _ = c.save(run, step, parent_id=parent)
        ids.append(cid)
        parent = cid
    return ids


@pytest.mark.slow
def test_plan_is_a_dry_run_and_execute_deletes_exactly_it(make_service, run_name):
    svc = make_service(**GC_ENV)
    c = Client(svc.grpc_target)
    try:
        ids = _chain(c, run_name, [10, 20, 30, 40, 50])
        dead = c.begin(run_name, step=60, parent_id=ids[-1], attempt="died").checkpoint_id
        c.put(dead, 0, "rank00000.safetensors", _shard_bytes())
        c.abort(dead)
    finally:
        c.close()
    h = http(svc)
    h.post(f"/api/v1/checkpoints/{ids[1]}/tags", json={"name": "keep-me"})
    h.put(f"/api/v1/checkpoints/{ids[2]}/pin")
    blobs_before = blob_files(svc)[0]

    plan = h.get("/api/v1/gc/plan", params={"full": "true"}).json()  # the blobs as listed: bytes as execute frees them
    planned = {d["checkpoint_id"]: d for d in plan["checkpoints"]}
    quick = h.get("/api/v1/gc/plan").json()  # the changed runs only, their bytes from the catalog's shards
    assert not quick["full"] and {d["checkpoint_id"] for d in quick["checkpoints"]} == set(planned)
    assert set(planned) == {ids[0], ids[3], dead}  # 50: latest, last-good, head; 20 tagged; 30 pinned
    assert planned[dead]["reason"].startswith("abandoned")
    assert plan["bytes_freed"] == sum(d["bytes"] for d in plan["checkpoints"]) > 0
    assert plan["policy"] == "latest:1,tagged,last-good,branch-heads"
    dry = h.post("/api/v1/gc", params={"dry_run": "true"}).json()
    assert dry["dry_run"] and "result" not in dry
    assert blob_files(svc)[0] == blobs_before  # a dry run changes nothing
    assert checkpoint(svc, ids[0])["status"] == "COMMITTED"

    done = h.post("/api/v1/gc").json()["result"]
    assert sorted(done["deleted"]) == sorted([ids[0], ids[3], dead]) and done["bytes_freed"] == plan["bytes_freed"]
    for cid in (ids[0], ids[3], dead):
        assert checkpoint(svc, cid)["status"] == "DELETED"
        assert not list(ckpt_dir(svc, cid).rglob("*"))
    for cid in (ids[1], ids[2], ids[4]):
        assert checkpoint(svc, cid)["status"] == "COMMITTED"
        assert http(svc).post(f"/api/v1/checkpoints/{cid}/verify").json()["ok"]
    assert last_good_id(svc, run_name) == ids[4]
    g = h.get(f"/api/v1/runs/{run_name}/lineage").json()
    assert len(g["nodes"]) == 6 and len(g["edges"]) == 5  # the lineage keeps its shape
    json_error(h.get(f"/api/v1/checkpoints/{ids[0]}/ranks/0/files/rank00000.safetensors"), 409)
    assert h.get("/api/v1/gc/plan").json()["checkpoints"] == []  # nothing left to do


def _shard_bytes() -> bytes:
    from .helpers import make_shard
    return make_shard(0)


@pytest.mark.slow
def test_execute_rechecks_and_never_exceeds_its_plan(make_service, run_name):
    """Domain-level: between plan and execute a checkpoint gets pinned, a restore takes a
    lease on another, and a third becomes deletable: execute skips the first two and does
    not touch the third (it was not in the plan)."""
    from lastgood_service.blobstore import open_blobstore
    from lastgood_service.catalog.db import make_engine, make_sessionmaker
    from lastgood_service.domain.runs.curation import Curator
    from lastgood_service.domain.gc import GarbageCollector

    svc = make_service(**GC_ENV)
    c = Client(svc.grpc_target)
    try:
        ids = _chain(c, run_name, [1, 2, 3, 4])
    finally:
        c.close()
    engine = make_engine(f"sqlite:///{svc.data_dir / 'catalog.db'}")
    sessions = make_sessionmaker(engine)
    gc = GarbageCollector(sessions, open_blobstore(f"file://{svc.blob_root}"),
                          Retention.parse(GC_ENV["LASTGOOD_RETENTION"]), grace_seconds=0)
    plan = gc.plan()
    assert {d.checkpoint_id for d in plan.checkpoints} == {ids[0], ids[1], ids[2]}
    cur = Curator(sessions)
    cur.pin(ids[0], True)
    lease = cur.acquire_lease(ids[1], "restore", 60)
    c = Client(svc.grpc_target)
    try:
        newest, _ = c.save(run_name, 5, parent_id=ids[3])  # ids[3] is now deletable, but not planned
    finally:
        c.close()
    result = gc.execute(plan)
    assert result["deleted"] == [ids[2]] and sorted(result["skipped"]) == [ids[0], ids[1]]
    assert checkpoint(svc, ids[3])["status"] == "COMMITTED"
    # control: once the lease is gone, a new plan does take ids[1] (and ids[3])
    cur.release_lease(lease["lease_id"])
    assert {d.checkpoint_id for d in gc.plan().checkpoints} == {ids[1], ids[3]}
    engine.dispose()


@pytest.mark.slow
def test_gc_in_a_loop_during_uploads_and_restores(make_service, run_name):
    svc = make_service(**GC_ENV)
    stop, errors, passes = threading.Event(), [], []

    def collect():
        h = http(svc)
        while not stop.is_set():
            r = h.post("/api/v1/gc")
            if r.status_code != 200:
                errors.append(r.text)
            passes.append(r.json().get("result", {}).get("deleted", []))

    gc_thread = threading.Thread(target=collect)
    gc_thread.start()
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        state = lastgood.TrainState(model=model)
        with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
            for step in range(12):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
                want = {k: v.clone() for k, v in model.state_dict().items()}
                ckpt.save(step, state)
                ckpt.wait()
                fresh = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
                assert ckpt.restore(lastgood.TrainState(model=fresh)) == step
                assert all(torch.equal(v, want[k]) for k, v in fresh.state_dict().items())
    finally:
        stop.set()
        gc_thread.join(30)
    assert not errors
    assert sum(len(p) for p in passes) >= 5  # GC really deleted while we worked
    # one pass after the last commit: the loop's last pass may have planned before it (a tiny
    # save is two calls now, and under load the last saves all committed within one pass)
    assert http(svc).post("/api/v1/gc").status_code == 200
    listing = http(svc).get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    committed = [c for c in listing if c["status"] == "COMMITTED"]
    assert [c["step"] for c in committed] == [11]
    assert http(svc).post(f"/api/v1/checkpoints/{committed[0]['id']}/verify").json()["ok"]


@pytest.mark.slow
def test_a_retried_save_after_gc_deleted_its_abandoned_sibling_is_not_a_branch(make_service, run_name):
    """A save that died (ABANDONED) and was then deleted by GC never claimed its parent:
    the retry under the same parent continues the branch, and branch-heads does not keep
    the old parent forever. Control: a committed child that GC deleted does still claim
    its parent, so a later sibling of it is a real branch."""
    svc = make_service(**GC_ENV)
    h = http(svc)
    with Client(svc.grpc_target) as c:
        ids = _chain(c, run_name, [10, 20])
        for round_ in range(3):  # a save dies, GC reclaims it, the retry commits
            dead = c.begin(run_name, step=30 + round_, parent_id=ids[-1], attempt=f"died-{round_}").checkpoint_id
            c.abort(dead)
            assert dead in h.post("/api/v1/gc").json()["result"]["deleted"]
            cid, _ = c.save(run_name, 30 + round_, parent_id=ids[-1], attempt=f"retry-{round_}")
            ids.append(cid)
            h.post("/api/v1/gc")
    g = h.get(f"/api/v1/runs/{run_name}/lineage").json()
    assert g["branches"] == 1
    listing = h.get(f"/api/v1/runs/{run_name}/checkpoints", params={"limit": 100}).json()["items"]
    assert [c["id"] for c in listing if c["status"] == "COMMITTED"] == [ids[-1]]  # latest:1 and nothing else

    # control: a committed checkpoint that GC deleted still claims its parent
    with Client(svc.grpc_target) as c:
        sibling, _ = c.save(run_name, 40, parent_id=ids[-2], attempt="restored-older")
    assert checkpoint(svc, ids[-2])["status"] == "DELETED"
    assert h.get(f"/api/v1/runs/{run_name}/lineage").json()["branches"] == 2
