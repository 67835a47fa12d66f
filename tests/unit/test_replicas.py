"""The pure parts of replicated state written once (lastgood/restore/replicas.py): who owns what,
which tensors the rule calls replicated, and the refs a rank's state holds instead. The
torchrun round trips are tests/multiproc/test_ddp_dedup.py."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lastgood
import lastgood.state.trainstate
from lastgood.restore import replicas
from lastgood.state.codec import decode
from lastgood.remote.config import ClientConfig


def test_owners_are_balanced_by_bytes_and_the_same_whatever_order_the_names_come_in():
    sizes = {f"t{i}": s for i, s in enumerate([1000] * 12 + [4, 8, 16, 1, 1])}
    owner = replicas.assign(sizes, 4)
    shuffled = list(sizes.items())
    random.Random(1).shuffle(shuffled)
    assert replicas.assign(dict(shuffled), 4) == owner  # no communication: every rank computes this
    load = [sum(sizes[n] for n, r in owner.items() if r == k) for k in range(4)]
    assert max(load) - min(load) <= 16 and sum(load) == sum(sizes.values())
    assert set(replicas.assign(sizes, 1).values()) == {0}


def test_the_dedup_switch_reads_the_client_words():
    assert ClientConfig.resolve(env={}).dedup is True
    assert ClientConfig.resolve(env={"LASTGOOD_DEDUP": "off"}).dedup is False
    assert ClientConfig.resolve(dedup=True, env={"LASTGOOD_DEDUP": "0"}).dedup is True


@pytest.fixture
def world_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    from tests.conftest import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _trained(ddp):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    net = nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    return lastgood.TrainState(model=net, optimizer=opt, scheduler=sched)


def test_only_ddp_parameters_and_their_optimizer_state_are_replicated(world_of_one):
    shared = replicas.shared_names(_trained(ddp=True), 1)
    assert shared == {"model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias",
                      *(f"optimizer.state.model.{p}.{k}" for p in ("0.weight", "0.bias", "1.weight", "1.bias")
                        for k in ("step", "exp_avg", "exp_avg_sq"))}
    assert not any("running" in n for n in shared)  # buffers: each rank's own batches
    assert replicas.shared_names(_trained(ddp=True), 2) == set()  # DDP over a group that is not the world
    assert replicas.shared_names(_trained(ddp=False), 1) == set()  # a plain module may differ per rank


def test_a_rank_names_the_tensors_others_own_and_restore_finds_each_one():
    cap = lastgood.state.trainstate.Captured({"version": 1, "components": {"m": {"kind": "module", "state": {
        "w": {"__tensor__": "m.w"}, "b": {"__tensor__": "m.b", "device": "cuda:1"}, "n": {"__tensor__": "m.n"}}}}},
        {})
    refs = replicas._refer(cap.json_state["components"], {"m.w": 2, "m.b": 3})
    assert refs["m"]["state"] == {"w": {"__replica__": "m.w", "rank": 2},
                                  "b": {"__replica__": "m.b", "rank": 3, "device": "cuda:1"},
                                  "n": {"__tensor__": "m.n"}}
    assert replicas.needed({"components": refs}) == {2: ["m.w"], 3: ["m.b"]}
    seen = []
    decode(refs, lambda name, device: seen.append((name, device)), lambda name: None)
    assert sorted(seen) == [("m.b", "cuda:1"), ("m.n", None), ("m.w", None)]


def test_an_owners_tensors_are_read_in_few_requests_with_bounded_gaps():
    t = {"a": {"offsets": [0, 100]}, "b": {"offsets": [100, 300]}, "gap": {"offsets": [300, 400]},
         "c": {"offsets": [400, 500]}, "far": {"offsets": [10_000, 10_100]}, "big": {"offsets": [10_100, 50_000]}}
    assert replicas._spans(t, ["c", "a", "b", "far"], window=1000, gap=200) == [
        (0, 500, ["a", "b", "c"]), (10_000, 10_100, ["far"])]
    # never more than a window a request, unless one tensor is larger
    assert replicas._spans(t, ["far", "big"], window=1000, gap=200) == [(10_000, 10_100, ["far"]),
                                                                        (10_100, 50_000, ["big"])]


def _ddp_state(prepare=None, hook=None, wrap_opt=None):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    if prepare:
        prepare(model)
    net = nn.parallel.DistributedDataParallel(model)
    if hook is not None:
        net.register_comm_hook(None, hook)
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(3, 4)).sum().backward()
    opt.step()
    return lastgood.TrainState(model=net, optimizer=wrap_opt(opt) if wrap_opt else opt)


def test_parameters_ddp_is_told_to_ignore_are_not_replicated(world_of_one):
    """DDP never syncs them, so they may differ per rank: each rank keeps its own."""
    ignore = lambda m: nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(  # noqa: E731
        m, ["1.weight"])
    shared = replicas.shared_names(_ddp_state(prepare=ignore), 1)
    assert "model.0.weight" in shared and "optimizer.state.model.0.weight.exp_avg" in shared
    assert not any("1.weight" in n for n in shared)
    assert {n for n in replicas.shared_names(_ddp_state(), 1) if "1.weight" in n}  # control: without it, shared


def test_a_ddp_module_with_a_communication_hook_is_not_replicated_unless_the_hook_is_plain_allreduce(world_of_one):
    """A hook such as Local SGD's averages only now and then: parameters and moments differ
    between periods while names and shapes match, so the fingerprint cannot tell."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def my_hook(state, bucket):
        return default_hooks.allreduce_hook(None, bucket)

    assert replicas.shared_names(_ddp_state(hook=my_hook), 1) == set()
    for plain in (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook):  # bf16: NCCL only
        assert "model.0.weight" in replicas.shared_names(_ddp_state(hook=plain), 1)


def test_a_local_sgd_optimizer_state_is_not_replicated(world_of_one):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    wrap = lambda opt: PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=4, warmup_steps=0))  # noqa: E731
    shared = replicas.shared_names(_ddp_state(wrap_opt=wrap), 1)
    assert "model.0.weight" in shared and not any(n.startswith("optimizer.") for n in shared)
    assert any(n.startswith("optimizer.") for n in replicas.shared_names(_ddp_state(), 1))  # control


@pytest.mark.parametrize("ref", [{"__replica__": "m.w", "rank": [1]}, {"__replica__": "m.w", "rank": {"a": 1}},
                                 {"__replica__": ["m.w"], "rank": 1}, {"__replica__": "m.w", "rank": True}])
def test_a_malformed_reference_is_a_damaged_checkpoint_that_ranks_fall_back_from(ref):
    """Not a TypeError, which would fail the restore instead of falling back."""
    from lastgood.errors import CorruptCheckpoint

    with pytest.raises(CorruptCheckpoint, match="replicated tensor reference"):
        replicas.needed({"components": {"m": {"state": {"w": ref}}}})
