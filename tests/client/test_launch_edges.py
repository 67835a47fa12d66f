"""The Checkpointer's edges that frameworks run into (#37): a step saved twice in one
launch (Lightning's top-k and save_last saves of one step) and a second Checkpointer of the
run in one process. The edge of a Checkpointer that not every rank creates is in
tests/multiproc/test_solo.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lastgood


def test_a_step_saved_twice_commits_the_second_as_a_newer_checkpoint(service, run_name):
    model = nn.Linear(3, 3)
    state = lastgood.TrainState(model=model)
    with lastgood.Checkpointer(service.url, run=run_name, heartbeat_seconds=0) as ckpt:
        ckpt.save(4, state)
        ckpt.wait()
        first = ckpt.last_saved.checkpoint_id
        with torch.no_grad():
            model.weight.fill_(7.0)  # B: another state of the same step
        ckpt.save(4, state)
        ckpt.wait()  # committed, not dropped: no "given up" and nothing for wait() to forgive
        second = ckpt.last_saved.checkpoint_id
        assert ckpt.stats == {"saves_committed": 2, "saves_given_up": 0}
    assert second != first
    lg = service.get(f"/api/v1/runs/{run_name}/last-good").json()
    assert (lg["id"], lg["step"], lg["parent_id"]) == (second, 4, first)

    fresh = nn.Linear(3, 3)
    with lastgood.Checkpointer(service.url, run=run_name, heartbeat_seconds=0) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=fresh)) == 4
    assert torch.equal(fresh.weight, torch.full((3, 3), 7.0))  # B, the newest save, not A


def test_the_newest_save_of_a_step_is_what_wait_judges(service, run_name):
    """save(4) commits, a second save(4) fails: wait() says the newest state did not commit
    (it judged by step, and the first save's step answered for the second)."""
    state = lastgood.TrainState(model=nn.Linear(2, 2))
    ckpt = lastgood.Checkpointer(service.url, run=run_name, heartbeat_seconds=0,
                                 retry=lastgood.remote.retry.RetryPolicy(deadline=0))
    try:
        ckpt.save(4, state)
        ckpt.wait()
        ckpt.transport.close()  # the second save cannot reach the service
        ckpt.save(4, state)
        with pytest.raises(lastgood.SaveFailed, match="NOT committed"):
            ckpt.wait()
    finally:
        ckpt.close()  # the failure was said once: close() does not raise it again


def test_a_second_checkpointer_of_the_run_in_one_process_is_refused_with_what_to_do(service, run_name):
    state = lastgood.TrainState(model=nn.Linear(2, 2))
    first = lastgood.Checkpointer(service.url, run=run_name, heartbeat_seconds=0)
    with pytest.raises(lastgood.LastgoodError, match="already open in this process.*close"):
        lastgood.Checkpointer(service.url, run=run_name, heartbeat_seconds=0)
    first.save(1, state)  # not fenced by the refused one: it registered nothing
    first.close()
    listing = service.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"]
    assert [(c["step"], c["status"], c["generation"]) for c in listing] == [(1, "COMMITTED", 1)]
    # once the first is closed, the next launch may open
    with lastgood.Checkpointer(service.url, run=run_name, heartbeat_seconds=0) as again:
        assert again.generation == 2
    # another run in the same process is no conflict
    with lastgood.Checkpointer(service.url, run=run_name + "-b", heartbeat_seconds=0), \
            lastgood.Checkpointer(service.url, run=run_name + "-c", heartbeat_seconds=0):
        pass
