"""Restore writes into what the trainer already has, and never leaves it sharing memory
with a staging buffer that a later save overwrites."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lastgood
import lastgood.state.trainstate

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

    def __init__(self, value: float, size: int = 4096) -> None:
        super().__init__()
        self.register_buffer("table", torch.full((size,), value))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        self.table = state_dict[prefix + "table"]


def _restore_then_save_other_values(service, run_name):
    keeper = Keeper(1.0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=keeper))
        ckpt.wait()
    restored = Keeper(0.0, size=1)  # a live buffer the stored one does not fit: it is handed a view of the download
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


def _two_group_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-3}])
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    return model, opt


def _failed_restore_keeps_moments(service, run_name):
    model, opt = _two_group_training()
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
    # the same parameters in one group: torch's load_state_dict refuses the saved two
    torch.manual_seed(1)
    model2 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt2 = torch.optim.AdamW(model2.parameters())
    model2(torch.randn(4, 8)).square().mean().backward()
    opt2.step()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt2.state.items()}
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        with pytest.raises(ValueError, match="parameter groups"):
            ckpt.restore(lastgood.TrainState(model=model2, optimizer=opt2))
    return all(torch.equal(v, before[id(p)][k]) for p, s in opt2.state.items() for k, v in s.items())


def test_a_refused_optimizer_load_leaves_its_moments_alone(service, run_name):
    assert _failed_restore_keeps_moments(service, run_name)


def test_control_copying_before_the_group_check_overwrites_moments(service, run_name, monkeypatch):
    monkeypatch.setattr(lastgood.state.trainstate, "_groups_match", lambda saved, opt: True)
    assert not _failed_restore_keeps_moments(service, run_name)


class ExtraKeeper(nn.Module):
    """Extra state that keeps the tensor it is handed (set_extra_state gets no copy)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.table = torch.full((4096,), value)

    def get_extra_state(self):
        return {"table": self.table}

    def set_extra_state(self, state) -> None:
        self.table = state["table"]


def _extra_state_after_a_later_save(service, run_name):
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=ExtraKeeper(1.0)))
        ckpt.wait()
    restored = ExtraKeeper(0.0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=restored)) == 1
        ckpt.save(2, lastgood.TrainState(model=ExtraKeeper(7.0)))
        ckpt.wait()
    return restored.table


def test_extra_state_gets_a_tensor_of_its_own(service, run_name):
    assert torch.equal(_extra_state_after_a_later_save(service, run_name), torch.full((4096,), 1.0))


def test_control_extra_state_handed_the_buffer_is_overwritten(service, run_name, monkeypatch):
    every = lastgood.TrainState.module_tensors  # the extra state named as a module tensor with no live tensor
    monkeypatch.setattr(lastgood.TrainState, "module_tensors",
                        lambda self: {**every(self), "model._extra_state.table": None})
    monkeypatch.setattr(lastgood.TrainState, "aliases", lambda self, buf: False)
    assert not torch.equal(_extra_state_after_a_later_save(service, run_name), torch.full((4096,), 1.0))
