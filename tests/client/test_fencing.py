"""A fenced Checkpointer (a newer launch of its run registered) raises lastgood.Fenced from
save() and wait(), uploads nothing more, and may still restore."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lastgood


def test_a_zombie_checkpointer_raises_fenced_and_commits_nothing(service, run_name):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    state = lastgood.TrainState(model=model)
    zombie = lastgood.Checkpointer(service.url, run=run_name, attempt="first-launch")
    assert zombie.generation == 1
    zombie.save(1, state)
    zombie.wait()
    kept = zombie.last_saved.checkpoint_id

    relaunch = lastgood.Checkpointer(service.url, run=run_name, attempt="second-launch")
    assert relaunch.generation == 2
    with torch.no_grad():
        model.weight.add_(1.0)
    zombie.save(2, state)  # returns: the refusal arrives in the background
    with pytest.raises(lastgood.Fenced, match="second-launch") as info:
        zombie.wait()
    assert not isinstance(info.value, lastgood.SaveFailed)  # a distinct error: do not carry on
    with pytest.raises(lastgood.Fenced):
        zombie.save(3, state)  # refused at once, nothing snapshot or sent
    with pytest.raises(lastgood.Fenced):
        zombie.close()

    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"]
    assert [(c["step"], c["status"], c["generation"]) for c in listing] == [(1, "COMMITTED", 1)]

    # restores are not fenced; the relaunch resumes from the zombie's last commit and saves on
    fresh = nn.Linear(4, 4)
    assert relaunch.restore(lastgood.TrainState(model=fresh)) == 1
    relaunch.save(2, lastgood.TrainState(model=fresh))
    relaunch.close()
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert lg["step"] == 2 and lg["generation"] == 2 and lg["parent_id"] == kept
