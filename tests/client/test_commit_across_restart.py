"""A commit that spans a service restart: the service dies after writing the manifest and
before its commit transaction; restarted on the same data and ports, it rolls the
checkpoint forward. Both ranks (two Checkpointers with RANK 0 and 1, one process) learn
the outcome through the retry policy, agree that it committed, and continue from it."""

from __future__ import annotations

import time

import pytest
from torch import nn

import lastgood
from lastgood.remote.retry import RetryPolicy


@pytest.mark.parametrize("retries", [True, False], ids=["retries", "control-no-retries"])
@pytest.mark.slow
def test_ranks_agree_on_a_commit_that_spans_a_restart(make_service, run_name, monkeypatch, retries):
    svc = make_service(LASTGOOD_FAILPOINT="crash_after_manifest", LASTGOOD_LEASE_SECONDS="60")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LASTGOOD_ATTEMPT", "launch-1")
    policy = RetryPolicy(deadline=120.0 if retries else 0.0)
    ranks = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        ranks.append(lastgood.Checkpointer(svc.url, run=run_name, retry=policy))
    models = [nn.Linear(4, 4), nn.Linear(4, 4)]
    for ck, m in zip(ranks, models):
        ck.save(1, lastgood.TrainState(model=m))
    assert svc.proc.wait(60) == 77  # the failpoint: died between the manifest and the commit
    time.sleep(8)  # a restart under load takes a while (longer than the client's old ~6 s of retries)
    svc.env.pop("LASTGOOD_FAILPOINT")
    svc.restart()
    first = svc.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert first["step"] == 1 and first["status"] == "COMMITTED"  # rolled forward at start-up

    if not retries:  # control: without retries neither rank hears that step 1 committed
        for ck in ranks:
            with pytest.raises(lastgood.SaveFailed, match="outcome unknown"):
                ck.wait()
    else:
        for ck in ranks:
            ck.wait()
            assert ck.last_saved.checkpoint_id == first["id"]
    # either way, the next save continues from the committed checkpoint on both ranks:
    # a rank that missed the outcome asks the service before it begins
    for ck, m in zip(ranks, models):
        ck.save(2, lastgood.TrainState(model=m))
    for ck in ranks:
        ck.wait()
        assert ck.parent_id == ck.last_saved.checkpoint_id
    second = svc.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert second["step"] == 2 and second["parent_id"] == first["id"]
    for ck in ranks:
        ck.close()
