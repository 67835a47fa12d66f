"""ddp_buckets.py in one process (a gloo world of one): the layout a save records is the
one DDP rebuilt, a fresh DDP is built anew in it, and a torch that lacks what the module
relies on, or builds its Reducer otherwise, raises instead of resuming in another layout.
Across ranks, bit for bit: tests/multiproc/test_ddp_buckets.py."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from lastgood.remote.config import ClientConfig
from lastgood.state import ddp_buckets
from lastgood.errors import DDPInternalsChanged
from tests.conftest import free_port

# the initial layout: every gradient in one bucket, in parameter order; the rebuilt one
# (after the first backward): in the order the gradients became ready, the last layer's first
INITIAL = [["a.weight", "a.bias", "b.weight", "b.bias"]]
REBUILT = [["b.bias", "b.weight", "a.bias", "a.weight"]]


@pytest.fixture(autouse=True)
def world_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp(**kwargs) -> nn.parallel.DistributedDataParallel:
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)), **kwargs)


def _step(ddp) -> None:
    ddp(torch.randn(2, 4)).sum().backward()


def _layout(ddp):  # nn.Sequential names its layers 0 and 1
    return [[n.replace("0.", "a.").replace("1.", "b.") for n in b] for b in ddp_buckets._read(ddp)]


def _as_saved(layout):
    return [[n.replace("a.", "0.").replace("b.", "1.") for n in b] for b in layout]


def test_a_save_records_the_layout_of_the_next_step_and_a_fresh_ddp_is_built_in_it():
    trained = _ddp()
    assert _layout(trained) == INITIAL
    assert ddp_buckets.layout(trained) == _as_saved(INITIAL)  # no backward yet: nothing to rebuild
    _step(trained)
    assert _layout(trained) == INITIAL  # DDP rebuilds only at the next forward
    saved = ddp_buckets.layout(trained)  # the rebuild is done here
    assert saved == _as_saved(REBUILT) and _layout(trained) == REBUILT

    reducer = trained.reducer
    ddp_buckets.establish(trained, saved)  # a rollback in the same process: already in that layout
    assert trained.reducer is reducer

    fresh = _ddp()
    ddp_buckets.establish(fresh, saved)
    assert fresh.reducer is not reducer
    assert _layout(fresh) == REBUILT
    _step(fresh), _step(fresh)  # it still reduces (and rebuilds once more, into the same layout)
    assert _layout(fresh) == REBUILT and all(p.grad is not None for p in fresh.parameters())


def test_a_python_communication_hook_is_kept_on_the_new_reducer():
    calls = []

    def counted(state, bucket):  # no annotations: torch compares them with its classes, not strings
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    trained = _ddp()
    _step(trained)
    saved = ddp_buckets.layout(trained)
    fresh = _ddp()
    fresh.register_comm_hook(None, counted)
    ddp_buckets.establish(fresh, saved)
    _step(fresh)
    assert calls == [0]  # one bucket, reduced through the hook


def test_a_ddp_that_never_rebuilds_keeps_its_layout():
    ddp = _ddp(find_unused_parameters=True)
    _step(ddp)
    assert ddp_buckets.layout(ddp) == _as_saved(INITIAL)
    _step(ddp)
    assert _layout(ddp) == INITIAL


def test_a_layout_that_does_not_name_the_parameters_leaves_ddp_as_built(caplog):
    for bad in ([["0.weight"]], [["0.weight", "0.weight", "1.weight", "1.bias"]], "0.weight", [[1, 2]]):
        ddp = _ddp()
        reducer = ddp.reducer
        with caplog.at_level(logging.WARNING, logger="lastgood"):
            ddp_buckets.establish(ddp, bad)
        assert ddp.reducer is reducer and _layout(ddp) == INITIAL
        assert "does not name the parameters" in caplog.text
        caplog.clear()


def test_a_torch_without_an_internal_it_relies_on_raises_naming_it(monkeypatch):
    ddp = _ddp()
    monkeypatch.delattr(dist, "_compute_bucket_assignment_by_size")
    with pytest.raises(DDPInternalsChanged, match="torch.distributed._compute_bucket_assignment_by_size.*"
                                                  "LASTGOOD_DDP_BUCKETS=0"):
        ddp_buckets.layout(ddp)


def test_a_reducer_built_in_another_layout_raises(monkeypatch):
    """Control for the read-back: a torch whose _ddp_init_helper ignores the assignment."""
    saved = _as_saved(REBUILT)
    ddp = _ddp()
    ddp_buckets.establish(ddp, saved)  # this torch: built as saved
    assert _layout(ddp) == REBUILT

    ddp = _ddp()
    helper, real = type(ddp)._ddp_init_helper, dist._compute_bucket_assignment_by_size

    def ignores_it(self, parameters, *args):
        patched = dist._compute_bucket_assignment_by_size
        patched(parameters, [1])  # called once, its answer unused
        dist._compute_bucket_assignment_by_size = real
        try:
            return helper(self, parameters, *args)
        finally:
            dist._compute_bucket_assignment_by_size = patched

    monkeypatch.setattr(type(ddp), "_ddp_init_helper", ignores_it)
    with pytest.raises(DDPInternalsChanged, match="not the saved"):
        ddp_buckets.establish(ddp, saved)


def test_the_switch_is_read_once_in_the_client_config():
    assert ClientConfig.resolve(env={}).ddp_buckets is True
    assert ClientConfig.resolve(env={"LASTGOOD_DDP_BUCKETS": "0"}).ddp_buckets is False
