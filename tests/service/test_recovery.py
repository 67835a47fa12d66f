"""Start-up recovery: a service that dies in the middle of a commit, restarted on the same data.

The failpoint setting (LASTGOOD_FAILPOINT, lastgood_service/failpoints.py) makes the process exit
with code 77 at a named point of `try_commit`:
  crash_after_manifest  -> manifest written, transaction not run: recovery rolls forward;
  crash_before_manifest -> no manifest: recovery leaves it PENDING and the lease abandons it.
"""

from __future__ import annotations

import grpc
import pytest

from .helpers import (Client, checkpoint, ckpt_dir, events, http, json_error, last_good_id, make_shard, shard_blob,
                      shard_name, wait_status)

# what a client may see when the server process vanishes under its call
GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
        grpc.StatusCode.CANCELLED)


def _crash_during_commit(svc, run: str, step: int) -> tuple[int, bytes]:
    """begin, put, vote on a 1-rank checkpoint; the vote kills the service. Returns (id, shard)."""
    c = Client(svc.grpc_target)
    try:
        cid = c.begin(run, step=step).checkpoint_id
        data = make_shard(0, seed=step)
        c.put(cid, 0, shard_name(0), data)
        with pytest.raises(grpc.RpcError) as info:
            c.vote(cid, 0, [shard_name(0)], wait=2)
        assert info.value.code() in GONE, info.value
    finally:
        c.close()
    assert svc.wait_exit(30) == 77
    return cid, data


@pytest.mark.slow
def test_crash_after_manifest_rolls_forward(make_service, run_name):
    first = make_service()
    c = Client(first.grpc_target)
    try:
        earlier, _ = c.save(run_name, step=1)
    finally:
        c.close()
    first.stop()

    crashing = make_service(data_dir=first.data_dir, LASTGOOD_FAILPOINT="crash_after_manifest")
    cid, data = _crash_during_commit(crashing, run_name, step=2)
    manifest_blob = ckpt_dir(crashing, cid) / "manifest.json"
    assert manifest_blob.exists(), "the failpoint fires after the manifest is written"

    svc = make_service(data_dir=first.data_dir)
    view = checkpoint(svc, cid)
    assert view["status"] == "COMMITTED" and view["last_good"] is True
    assert last_good_id(svc, run_name) == cid
    assert view["manifest"]["ranks"][0]["files"][0]["name"] == shard_name(0)
    assert http(svc).get(f"/api/v1/checkpoints/{cid}/manifest").content == manifest_blob.read_bytes()
    got = http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}")
    assert got.status_code == 200 and got.content == data
    commits = [e for e in events(svc, run_name) if e["kind"] == "commit" and e["checkpoint_id"] == cid]
    assert len(commits) == 1 and commits[0]["data"]["recovered"] is True
    assert checkpoint(svc, earlier)["status"] == "COMMITTED"

    # the rank that never heard back retries its vote and now hears COMMITTED
    c = Client(svc.grpc_target)
    try:
        assert c.vote(cid, 0, [shard_name(0)], wait=0).status == "COMMITTED"
    finally:
        c.close()


@pytest.mark.slow
def test_crash_before_manifest_waits_for_expiry(make_service, run_name):
    # CONTROL for the test above: no manifest was written, so recovery must not roll forward.
    # A 15 s lease on the crashing service (the expiry time is stored in the catalog) makes
    # sure the restarted service is up before the lease can run out, even on a loaded machine
    # (5 s was not always enough).
    crashing = make_service(LASTGOOD_FAILPOINT="crash_before_manifest", LASTGOOD_LEASE_SECONDS="15")
    cid, data = _crash_during_commit(crashing, run_name, step=1)
    assert not (ckpt_dir(crashing, cid) / "manifest.json").exists()

    svc = make_service(data_dir=crashing.data_dir)
    view = checkpoint(svc, cid)
    assert view["status"] == "PENDING" and view["manifest"] is None
    assert last_good_id(svc, run_name) is None
    json_error(http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}"), 409)

    view = wait_status(svc, cid, "ABANDONED", timeout=30)
    assert view["manifest"] is None
    assert last_good_id(svc, run_name) is None
    kinds = [e["kind"] for e in events(svc, run_name) if e["checkpoint_id"] == cid]
    assert "expired" in kinds and "commit" not in kinds
    # the shard was verified and stored, yet nothing of it is visible
    assert shard_blob(svc, cid, 0).is_file()
    json_error(http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/{shard_name(0)}"), 409)
