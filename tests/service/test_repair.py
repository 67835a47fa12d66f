"""The store is the source of truth: a catalog that lost acknowledged commits is detected at
start-up (writes and last-good refused with the command to run), `lastgood-service fsck`
reports what disagrees, and `lastgood-service rebuild` brings every lost commit back,
byte for byte, from the manifests in the blob store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import lastgood
from lastgood.errors import ServiceError
from lastgood.remote.retry import is_transient
import pytest

from .helpers import Client, checkpoint, ckpt_dir, http, json_error, last_good_id, rpc_error, shard_name

pytestmark = pytest.mark.slow  # service restarts / a mounted volume


def unavailable(resp) -> str:
    """A 503 with the JSON error body: the service's own state, not the caller's mistake."""
    assert resp.status_code == 503, resp.text[:300]
    err = resp.json()["error"]
    assert err["code"] == "catalog_behind"  # not "unavailable": clients do not retry it
    return err["message"]


def repair(svc_dir, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "LASTGOOD_DATA_DIR": str(svc_dir)}
    return subprocess.run([sys.executable, "-m", "lastgood_service.main", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_destroyed_wal_is_detected_and_rebuilt_from_the_store(make_service, run_name, tmp_path):
    svc = make_service(tmp_path / "svc")
    acked: dict[int, bytes] = {}
    with Client(svc.grpc_target) as c:
        parent = 0
        for step in range(1, 13):
            cid, shards = c.save(run_name, step * 10, parent_id=parent)
            acked[cid], parent = shards[0], cid
    newest = parent
    svc.kill()  # a crash: the WAL is not checkpointed into the database file
    wal = tmp_path / "svc" / "catalog.db-wal"
    assert wal.exists() and wal.stat().st_size > 0
    wal.unlink()
    (tmp_path / "svc" / "catalog.db-shm").unlink(missing_ok=True)

    svc = make_service(tmp_path / "svc")
    # every acknowledged commit is gone from the catalog, and the service says so instead of
    # serving an older last-good or handing the lost ids out again
    for cid in acked:
        json_error(http(svc).get(f"/api/v1/checkpoints/{cid}"), 404)
    assert "lastgood-service rebuild" in unavailable(http(svc).get(f"/api/v1/runs/{run_name}/last-good"))
    with Client(svc.grpc_target) as c:
        e = rpc_error(grpc.StatusCode.UNAVAILABLE, c.begin, run_name, step=999)
        assert "lastgood-service rebuild" in e.details() and "12 committed" in e.details()
    unavailable(http(svc).post("/api/v1/gc"))  # GC would take the lost commits' blobs for garbage
    # nor tags, rollbacks, events or a new launch's registration; and the client does not
    # wait out its retry deadline for what only an operator can end
    unavailable(http(svc).post(f"/api/v1/runs/{run_name}/events", json={"kind": "note", "data": {}}))
    unavailable(http(svc).post(f"/api/v1/runs/{run_name}/launches", json={"attempt": "relaunch", "world_size": 1}))
    with pytest.raises(ServiceError) as refused:
        lastgood.Checkpointer(svc.url, run=run_name).restore(lastgood.TrainState(extra={}))
    assert refused.value.reason == "catalog_behind" and not is_transient(refused.value)
    svc.stop()

    fsck = repair(tmp_path / "svc", "fsck", "--json")
    assert fsck.returncode == 1, fsck.stderr
    report = json.loads(fsck.stdout)
    assert report["counts"] == {"lost_commit": 12}
    assert sorted(f["checkpoint_id"] for f in report["findings"]) == sorted(acked)

    rebuilt = repair(tmp_path / "svc", "rebuild")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert sorted(json.loads(rebuilt.stdout)["restored"]) == sorted(acked)
    again = repair(tmp_path / "svc", "fsck")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "consistent" in again.stdout

    svc = make_service(tmp_path / "svc")
    assert last_good_id(svc, run_name) == newest
    for cid, data in acked.items():
        view = checkpoint(svc, cid)  # with every tensor index, from the objects the rebuilt rows name
        assert view["status"] == "COMMITTED" and view["manifest"]["ranks"][0]["files"][0]["tensors"]
        got = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}")
        assert got.status_code == 200 and got.content == data
        assert http(svc).post(f"/api/v1/checkpoints/{cid}/verify").json()["ok"]
    g = http(svc).get(f"/api/v1/runs/{run_name}/lineage").json()
    assert g["branches"] == 1 and len(g["edges"]) == 11
    with Client(svc.grpc_target) as c:  # writes are served again, under ids of their own
        cid, _ = c.save(run_name, 130, parent_id=newest)
    assert cid > max(acked) and last_good_id(svc, run_name) == cid


def test_fsck_reports_missing_and_damaged_blobs_and_a_healthy_store_is_consistent(make_service, run_name,
                                                                                  tmp_path):
    svc = make_service(tmp_path / "svc")
    with Client(svc.grpc_target) as c:
        a, _ = c.save(run_name, 1)
        b, _ = c.save(run_name, 2, parent_id=a)
    svc.stop()
    clean = repair(tmp_path / "svc", "fsck", "--rehash")
    assert clean.returncode == 0 and "consistent" in clean.stdout  # control
    next((ckpt_dir(svc, a) / "r0").iterdir()).unlink()
    manifest = ckpt_dir(svc, b) / "manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step":2', b'"step":3'))
    bad = repair(tmp_path / "svc", "fsck", "--json")
    assert bad.returncode == 1
    kinds = {(f["kind"], f["checkpoint_id"]) for f in json.loads(bad.stdout)["findings"]}
    assert kinds == {("missing_blob", a), ("manifest_mismatch", b)}


def test_a_rebuilt_catalog_keeps_fencing_the_launches_it_forgot(make_service, run_name, tmp_path):
    """Generations live in the catalog; a rebuild from the store must not hand one out again.
    Launch 1 and launch 2 commit, the catalog is lost and rebuilt, a relaunch registers: the
    zombies of launches 1 and 2 are fenced, and no relaunch ever gets their generations back."""
    from lastgood.wire.codes import ERROR_METADATA, FENCED

    svc = make_service(tmp_path / "svc")
    api = http(svc)

    def register(attempt: str) -> int:
        r = api.post(f"/api/v1/runs/{run_name}/launches", json={"attempt": attempt, "world_size": 1})
        assert r.status_code == 200, r.text
        return r.json()["generation"]

    with Client(svc.grpc_target) as c:
        first = register("first")
        kept, _ = c.save(run_name, 10, attempt="first", generation=first)
        second = register("second")
        newest, _ = c.save(run_name, 20, parent_id=kept, attempt="second", generation=second)
    assert (first, second) == (1, 2)
    svc.kill()
    (tmp_path / "svc" / "catalog.db-wal").unlink()
    (tmp_path / "svc" / "catalog.db-shm").unlink(missing_ok=True)
    rebuilt = repair(tmp_path / "svc", "rebuild")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert sorted(json.loads(rebuilt.stdout)["restored"]) == [kept, newest]

    svc = make_service(tmp_path / "svc")
    api = http(svc)
    relaunches = [register(f"relaunch-{i}") for i in range(3)]
    assert min(relaunches) > second  # never a generation an older launch may still hold
    with Client(svc.grpc_target) as c:
        for zombie, gen in (("first", first), ("second", second)):
            e = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, c.begin, run_name, step=30, parent_id=newest,
                          attempt=zombie, generation=gen)
            assert dict(e.trailing_metadata())[ERROR_METADATA] == FENCED, e.details()
        cid, _ = c.save(run_name, 30, parent_id=newest, attempt="relaunch-2", generation=relaunches[-1])
    assert last_good_id(svc, run_name) == cid
    assert checkpoint(svc, newest)["status"] == "COMMITTED"


def test_a_planted_manifest_never_stops_writes_and_rebuild_quarantines_it(make_service, run_name, tmp_path):
    """Anyone who can write the store (a direct-FS writer under its root) can plant a manifest
    with an id, run, step and nonce computed from public fields, plus one shard blob. Neither
    one with no seal (as on a store before seals) nor one with a made-up seal makes the
    restarted service refuse writes, and `rebuild` restores neither (#36). What a service
    started after the rebuild finds is tests/catalog/test_rebuild_trust.py's lost_manifests()."""
    from lastgood_service.blobstore import LocalBlobStore
    from tests.catalog.test_rebuild_trust import plant

    svc = make_service(tmp_path / "svc")
    with Client(svc.grpc_target) as c:
        kept, _ = c.save(run_name, 10)
    svc.stop()
    store = LocalBlobStore(tmp_path / "svc" / "blobs")
    key_id = (tmp_path / "svc" / "manifest.keys").read_text().split(":")[0]  # ids are no secret
    plant(store, 5000, run_name, 20, "forger", 0, kept)
    forged = plant(store, 5001, run_name, 30, "forger", 0, kept, mac=key_id)

    svc = make_service(tmp_path / "svc")
    with Client(svc.grpc_target) as c:  # on a store without seals this was UNAVAILABLE: "catalog behind"
        cid, _ = c.save(run_name, 40, parent_id=kept)
    assert last_good_id(svc, run_name) == cid
    svc.stop()

    rebuilt = repair(tmp_path / "svc", "rebuild")
    assert rebuilt.returncode == 4, rebuilt.stderr  # something needs a look
    out = json.loads(rebuilt.stdout)
    assert out["restored"] == [] and [u["checkpoint_id"] for u in out["unsealed"]] == [5000]
    assert [q["moved_to"] for q in out["quarantined"]] == [f"quarantine/{forged}"]
    assert (svc.blob_root / "blobs" / "quarantine" / forged).exists() and not (svc.blob_root / "blobs" / forged).exists()
