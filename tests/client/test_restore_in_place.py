"""Restore writes into what the trainer already has, and never leaves it sharing memory
with a staging buffer that a later save overwrites."""

from __future__ import annotations

import torch
from torch import nn

import lastgood

from .test_roundtrip import make_training, snapshot_of, train_steps


def test_restore_copies_into_the_existing_optimizer_state(service, run_name):
    model, opt, sched = make_training()
    train_steps(model, opt, sched, 3)
    state = lastgood.TrainState(model=model, optimizer=opt, scheduler=sched)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(3, state)
        ckpt.wait()
        want = snapshot_of(model, opt, sched)
        train_steps(model, opt, sched, 2)  # weights and moments move on
        moments = {i: dict(s) for i, s in opt.state.items()}
        params = list(model.parameters())
        assert ckpt.restore(state) == 3
        got = snapshot_of(model, opt, sched)
    for k in want[0]:
        assert torch.equal(want[0][k], got[0][k]), k
    for i in want[1]:
        for k in want[1][i]:
            assert torch.equal(want[1][i][k], got[1][i][k]), (i, k)
    assert want[3] == got[3]
    # the same tensor objects, written in place: nothing new was allocated for them
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    for p, per_param in opt.state.items():
        for k, v in per_param.items():
            assert v is moments[p][k], k


class Keeper(nn.Module):
    """A module whose custom load keeps the tensor it is handed instead of copying it."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.register_buffer("table", torch.full((4096,), value))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        self.table = state_dict[prefix + "table"]


def _restore_then_save_other_values(service, run_name):
    keeper = Keeper(1.0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=keeper))
        ckpt.wait()
    restored = Keeper(0.0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=restored)) == 1
        assert torch.equal(restored.table, torch.full((4096,), 1.0))
        # the next save stages another state of the same layout
        ckpt.save(2, lastgood.TrainState(model=Keeper(7.0)))
        ckpt.wait()
    return restored.table


def test_a_component_that_keeps_restored_memory_keeps_it_safe(service, run_name):
    table = _restore_then_save_other_values(service, run_name)
    assert torch.equal(table, torch.full((4096,), 1.0))


def test_control_without_the_alias_check_a_later_save_overwrites_restored_state(service, run_name, monkeypatch):
    monkeypatch.setattr(lastgood.TrainState, "aliases", lambda self, buf: False)
    table = _restore_then_save_other_values(service, run_name)
    assert not torch.equal(table, torch.full((4096,), 1.0))  # the staging buffer was reused under it
