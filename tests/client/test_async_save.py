"""save() is asynchronous and isolated; failures surface in wait(); restore falls back
past a corrupt checkpoint."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from torch import nn

import lastgood
from lastgood.remote.retry import RetryPolicy
from lastgood.state.staging import StagingPool
from tests.service.helpers import shard_blob


def big_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])  # ~8 MiB of weights


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_in_flight_upload_never_sees_later_training_writes(service, run_name):
    model = big_model()
    state = lastgood.TrainState(model=model)
    expected = {}
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        for step in range(4):
            expected[step] = weights(model)
            ckpt.save(step, state)
            with torch.no_grad():  # "training" overwrites the weights at once
                for p in model.parameters():
                    p.mul_(-1.5).add_(1.0)
        ckpt.wait()
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"]
    assert sorted(c["step"] for c in listing) == [0, 1, 2, 3]
    assert all(c["status"] == "COMMITTED" for c in listing)
    for c in listing:
        fresh = big_model(seed=1)
        with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
            ckpt.restore(lastgood.TrainState(model=fresh), checkpoint_id=c["id"])
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, expected[c["step"]][k]), (c["step"], k)


def test_save_returns_before_the_commit(service, run_name, monkeypatch):
    """With two ranks, rank 0's save() returns although nothing can commit before rank 1 votes."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LASTGOOD_ATTEMPT", "launch-1")
    monkeypatch.setenv("RANK", "0")
    ck0 = lastgood.Checkpointer(service.url, run=run_name)
    monkeypatch.setenv("RANK", "1")
    ck1 = lastgood.Checkpointer(service.url, run=run_name)
    m0, m1 = nn.Linear(4, 4), nn.Linear(4, 4)
    ck0.save(10, lastgood.TrainState(model=m0))
    assert service.get(f"/api/v1/runs/{run_name}/last-good").status_code in (404,)  # not committed yet
    ck1.save(10, lastgood.TrainState(model=m1))
    ck0.wait()
    ck1.wait()
    lg = service.get(f"/api/v1/runs/{run_name}/last-good", params={"manifest": "true"}).json()
    assert lg["step"] == 10 and lg["world_size"] == 2
    assert [r["rank"] for r in lg["manifest"]["ranks"]] == [0, 1]
    ck0.close(), ck1.close()


def test_failed_save_raises_in_wait_and_never_moves_last_good(service, run_name, monkeypatch):
    monkeypatch.setenv("LASTGOOD_ATTEMPT", "same-launch")
    good = nn.Linear(8, 8)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(3, lastgood.TrainState(model=good))
        ckpt.wait()
        first = ckpt.last_saved.checkpoint_id
    # a zombie of the same launch saves the same step with other bytes: refused
    zombie = lastgood.Checkpointer(service.url, run=run_name)
    zombie.save(3, lastgood.TrainState(model=nn.Linear(8, 8)))
    with pytest.raises(lastgood.SaveFailed, match="different bytes"):
        zombie.wait()
    zombie.close()
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["id"] == first
    restored = nn.Linear(8, 8)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=restored)) == 3
    assert torch.equal(restored.weight, good.weight)


@pytest.mark.slow
def test_failed_save_when_the_service_is_gone(make_service, run_name):
    svc = make_service()
    model = nn.Linear(4, 4)
    ckpt = lastgood.Checkpointer(svc.url, run=run_name)
    ckpt.save(1, lastgood.TrainState(model=model))
    ckpt.wait()
    ckpt.transport.retry = RetryPolicy(deadline=1.0)  # the newest save cannot commit: wait() raises soon
    data_dir = svc.data_dir
    svc.stop()
    ckpt.save(2, lastgood.TrainState(model=model))
    with pytest.raises(lastgood.SaveFailed):
        ckpt.wait()
    ckpt.transport.close()
    svc2 = make_service(data_dir=data_dir)
    assert httpx.get(f"{svc2.url}/api/v1/runs/{run_name}/last-good").json()["step"] == 1


def test_staging_pool_blocks_until_a_buffer_is_free():
    pool = StagingPool(slots=1, pin=False)
    first = pool.acquire(100)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(50)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got  # the only buffer is busy: the snapshot waits
    pool.release(first)
    t.join(10)
    assert got and got[0].data_ptr() == first.data_ptr()  # and the buffer is reused


@pytest.mark.slow
def test_restore_falls_back_past_a_corrupt_checkpoint(make_service, run_name):
    svc = make_service()
    model = nn.Linear(16, 16)
    state = lastgood.TrainState(model=model)
    saved = {}
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        for step in (1, 2):
            saved[step] = weights(model)
            ckpt.save(step, state)
            ckpt.wait()
            with torch.no_grad():
                model.weight.add_(1)
        newest = ckpt.last_saved.checkpoint_id
    # control: intact, restore picks the newest
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=nn.Linear(16, 16))) == 2
    blob = shard_blob(svc, newest, 0)
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0xFF  # flip bits in the last tensor byte
    blob.write_bytes(bytes(raw))
    fresh = nn.Linear(16, 16)
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=fresh)) == 1
    assert torch.equal(fresh.weight, saved[1]["weight"])
    assert svc.get(f"/api/v1/checkpoints/{newest}").json()["status"] == "CORRUPT"
    assert svc.get(f"/api/v1/runs/{run_name}/last-good").json()["step"] == 1
    kinds = [e["kind"] for e in svc.get(f"/api/v1/runs/{run_name}/events").json()["items"]]
    assert "corrupt" in kinds


@pytest.mark.slow
def test_a_lost_commit_reply_is_not_a_failed_save(make_service, run_name):
    """The service commits, then the reply is lost: the client asks, finds its own bytes
    committed, and carries on; its next save continues the lineage."""
    svc = make_service(LASTGOOD_FAILPOINT="lose_commit_reply")
    model = nn.Linear(4, 4)
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=model))
        ckpt.wait()  # no SaveFailed
        first = ckpt.last_saved.checkpoint_id
        ckpt.save(2, lastgood.TrainState(model=model))
        ckpt.wait()
        second = ckpt.last_saved.checkpoint_id
    detail = svc.get(f"/api/v1/checkpoints/{second}").json()
    assert detail["status"] == "COMMITTED" and detail["parent_id"] == first
    assert svc.get(f"/api/v1/runs/{run_name}/last-good").json()["id"] == second
    # control: the failpoint really failed the replies
    assert "lose_commit_reply" in svc.log.read_text()


@pytest.mark.slow
def test_a_lost_reply_with_the_manifest_unreadable_is_unknown_not_other_bytes(make_service, run_name, monkeypatch):
    """The commit's reply is lost and the manifest cannot be read (a proxy answers 503) while
    the client checks what committed: the outcome is unknown (asked again before the next
    save), not "committed with other bytes", which would leave the lineage a dead end."""
    from .proxy import proxy

    monkeypatch.setenv("LASTGOOD_RETRY_DEADLINE", "2")
    svc = make_service(LASTGOOD_FAILPOINT="lose_commit_reply")
    model = nn.Linear(4, 4)
    with proxy(svc.url, "/api/v1/checkpoints/", 503) as (url, handler):
        handler.fail_path = ""
        ckpt = lastgood.Checkpointer(url, run=run_name, heartbeat_seconds=0)
        try:
            cid = None
            handler.fail_path = "/api/v1/checkpoints/1/manifest"  # the run's first checkpoint
            ckpt.save(1, lastgood.TrainState(model=model))
            with pytest.raises(lastgood.SaveFailed) as failed:
                ckpt.wait()
            assert "outcome unknown" in str(failed.value), failed.value
            handler.fail_path = ""
            ckpt.save(2, lastgood.TrainState(model=model))  # settles step 1 first: committed, with its bytes
            ckpt.wait()
            cid = ckpt.last_saved.checkpoint_id
        finally:
            ckpt.close()
    assert svc.get(f"/api/v1/checkpoints/{cid}").json()["parent_id"] == 1
