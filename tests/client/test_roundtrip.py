"""Round trip of every state component through a real service, checked for exact equality."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import lastgood


def make_training(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.LayerNorm(16), nn.Linear(16, 3))
    model.register_buffer("half_buf", torch.randn(4).half())
    model.register_buffer("bf16_buf", torch.randn(4).bfloat16())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    return model, opt, sched


def train_steps(model, opt, sched, n):
    for _ in range(n):
        loss = model(torch.randn(5, 6)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def snapshot_of(model, opt, sched):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            [dict(g) for g in opt.state_dict()["param_groups"]], sched.state_dict())


def test_model_optimizer_scheduler_step_extra_roundtrip(service, run_name):
    model, opt, sched = make_training()
    train_steps(model, opt, sched, 7)
    extra = {"epoch": 2, "tokens_seen": 123456789012, "name": "x", "nested": {"a": [1, 2.5]}}
    state = lastgood.TrainState(model=model, optimizer=opt, scheduler=sched, extra=extra)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(7, state)
        ckpt.wait()
    want = snapshot_of(model, opt, sched)
    want_extra = {k: v for k, v in extra.items()}

    model2, opt2, sched2 = make_training(seed=1)  # different weights, no optimizer state yet
    extra2: dict = {"stale": True}
    state2 = lastgood.TrainState(model=model2, optimizer=opt2, scheduler=sched2, extra=extra2)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(state2) == 7
    got = snapshot_of(model2, opt2, sched2)
    for k in want[0]:
        assert want[0][k].dtype == got[0][k].dtype and torch.equal(want[0][k], got[0][k]), k
    assert want[1].keys() == got[1].keys()
    for i in want[1]:
        assert set(want[1][i]) == {"exp_avg", "exp_avg_sq", "step"}
        for k in want[1][i]:
            assert torch.equal(want[1][i][k], got[1][i][k]), (i, k)
    assert want[2] == got[2]  # every param-group field, lr included
    assert want[3] == got[3]
    assert extra2 == want_extra  # restored in place
    # and training continues identically
    torch.manual_seed(5)
    train_steps(model, opt, sched, 2)
    torch.manual_seed(5)
    train_steps(model2, opt2, sched2, 2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k


def test_every_rng_roundtrips(service, run_name):
    gen = torch.Generator().manual_seed(42)
    torch.rand(3, generator=gen)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    state = lastgood.TrainState(gen=gen)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
    want = (random.random(), np.random.rand(5).tolist(), np.random.randn(), torch.rand(4), torch.rand(2, generator=gen))
    random.seed(9), np.random.seed(9), torch.manual_seed(9), gen.manual_seed(9)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(state) == 1
    got = (random.random(), np.random.rand(5).tolist(), np.random.randn(), torch.rand(4), torch.rand(2, generator=gen))
    assert want[0] == got[0] and want[1] == got[1] and want[2] == got[2]
    assert torch.equal(want[3], got[3]) and torch.equal(want[4], got[4])


class Indexed(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return i


def _consume(loader, n):
    it = iter(loader)
    return [next(it).tolist() for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_cursor_counts_consumed_not_prefetched(service, run_name, workers):
    def make():
        return StatefulDataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=workers,
                                  prefetch_factor=4 if workers else None)

    torch.manual_seed(0)
    loader = make()
    state = lastgood.TrainState(loader=loader)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]  # workers have prefetched far more than 3
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(3, state)
        ckpt.wait()
    rest_reference = [b.tolist() for b in it]

    torch.manual_seed(123)
    loader2 = make()
    state2 = lastgood.TrainState(loader=loader2)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(state2) == 3
    rest = [b.tolist() for b in loader2]
    assert rest == rest_reference
    assert sorted(sum(seen + rest, [])) == list(range(40))  # nothing repeated or skipped


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_dataloader_with_resumable_sampler(service, run_name, workers):
    def make():
        sampler = lastgood.ResumableDistributedSampler(Indexed(), num_replicas=2, rank=1, seed=7)
        return sampler, DataLoader(Indexed(), batch_size=3, sampler=sampler, num_workers=workers)

    sampler, loader = make()
    state = lastgood.TrainState(loader=loader)
    sampler.set_epoch(4)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(2)]
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(2, state)
        ckpt.wait()
    assert sampler.state_dict()["consumed"] == 6  # two batches of three, whatever was prefetched
    rest_reference = [b.tolist() for b in it]

    sampler2, loader2 = make()
    state2 = lastgood.TrainState(loader=loader2)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.restore(state2)
    sampler2.set_epoch(4)  # the loop calls set_epoch as always: the position survives
    rest = [b.tolist() for b in loader2]
    assert rest == rest_reference
    assert len(sum(seen + rest, [])) == 20
    sampler2.set_epoch(5)  # a new epoch starts at its beginning
    assert len(sum([b.tolist() for b in loader2], [])) == 20


def test_shard_opens_with_safetensors_and_names_are_readable(service, run_name, tmp_path):
    from safetensors import safe_open

    model, opt, sched = make_training()
    train_steps(model, opt, sched, 1)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=model, optimizer=opt, scheduler=sched))
        ckpt.wait()
        cid = ckpt.last_saved.checkpoint_id
    r = service.get(f"/api/v1/checkpoints/{cid}/ranks/0/files/rank00000.safetensors")
    assert r.status_code == 200
    path = tmp_path / "rank0.safetensors"
    path.write_bytes(r.content)
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        assert "model.0.weight" in keys and "optimizer.state.model.0.weight.exp_avg" in keys
        assert "optimizer.state.model.3.bias.exp_avg_sq" in keys and "rng.torch" in keys
        assert torch.equal(f.get_tensor("model.0.weight"), model.state_dict()["0.weight"])
        assert "lastgood.state" in f.metadata()


def test_restore_of_a_run_without_checkpoints_returns_none(service, run_name):
    model, opt, sched = make_training()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=model)) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_trainstate_mismatch_is_a_clear_error(service, run_name):
    model, opt, sched = make_training()
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(0, lastgood.TrainState(model=model))
        ckpt.wait()
        with pytest.raises(lastgood.LastgoodError, match="optimizer"):
            ckpt.restore(lastgood.TrainState(model=model, optimizer=opt))
