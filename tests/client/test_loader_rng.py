"""The DataLoader RNG trap, with its control.

Every DataLoader iterator draws a base seed from the global torch RNG when it is created.
A resumed run creates its first iterator after the restore, so restoring the RNG and the
loader the obvious way leaves the global RNG one draw ahead of the uninterrupted run, and
every later dropout mask differs. The control shows the trap is real; the test shows
TrainState's restore avoids it.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import lastgood


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return i


def make_loader(kind: str):
    if kind == "stateful":
        sampler = DistributedSampler(Items(), num_replicas=1, rank=0, shuffle=True, seed=3)
        return sampler, StatefulDataLoader(Items(), batch_size=4, sampler=sampler, num_workers=1)
    sampler = lastgood.ResumableDistributedSampler(Items(), num_replicas=1, rank=0, seed=3)
    return sampler, DataLoader(Items(), batch_size=4, sampler=sampler, num_workers=1)


def run_rest(sampler, loader):
    """The rest of epoch 0 and all of epoch 1, with one 'dropout' draw per batch."""
    out = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        for batch in loader:
            out.append((batch.tolist(), torch.rand(1).item()))
    return out


def checkpoint_after_two_batches(kind):
    torch.manual_seed(0)
    sampler, loader = make_loader(kind)
    state = lastgood.TrainState(loader=loader)
    sampler.set_epoch(0)
    it = iter(loader)
    for _ in range(2):
        next(it), torch.rand(1)
    cap = state.capture(step=1, rank=0, world_size=1)
    reference = []
    for batch in it:
        reference.append((batch.tolist(), torch.rand(1).item()))
    sampler.set_epoch(1)
    for batch in loader:
        reference.append((batch.tolist(), torch.rand(1).item()))
    return cap, reference


@pytest.mark.parametrize("kind", ["stateful", "plain"])
def test_trainstate_restore_is_bit_exact_across_the_loader_rng_draw(kind):
    cap, reference = checkpoint_after_two_batches(kind)
    torch.manual_seed(999)
    sampler, loader = make_loader(kind)
    state = lastgood.TrainState(loader=loader)
    state.apply(cap.json_state, lambda n, d: cap.tensors[n], lambda n: cap.tensors[n])
    assert run_rest(sampler, loader) == reference


def test_control_naive_restore_diverges():
    """Without lastgood's guard: restore the loader and the RNG by hand, as one would."""
    torch.manual_seed(0)
    sampler, loader = make_loader("stateful")
    sampler.set_epoch(0)
    it = iter(loader)
    for _ in range(2):
        next(it), torch.rand(1)
    loader_state, rng_state = loader.state_dict(), torch.get_rng_state()
    reference = [(b.tolist(), torch.rand(1).item()) for b in it]
    sampler.set_epoch(1)
    reference += [(b.tolist(), torch.rand(1).item()) for b in loader]

    torch.manual_seed(999)
    sampler2, loader2 = make_loader("stateful")
    loader2.load_state_dict(loader_state)
    torch.set_rng_state(rng_state)
    resumed = run_rest(sampler2, loader2)
    assert [b for b, _ in resumed] == [b for b, _ in reference]  # the data order survives...
    assert [r for _, r in resumed] != [r for _, r in reference]  # ...but the random stream does not


def test_plain_loader_saved_between_epochs_is_bit_exact():
    """Saved after an epoch's loop ended: the next epoch's iterator draws in both runs."""
    def make():
        sampler = lastgood.ResumableDistributedSampler(Items(), num_replicas=1, rank=0, seed=3)
        return sampler, DataLoader(Items(), batch_size=4, sampler=sampler, num_workers=1)

    torch.manual_seed(0)
    sampler, loader = make()
    state = lastgood.TrainState(loader=loader)
    sampler.set_epoch(0)
    for _ in loader:
        torch.rand(1)
    cap = state.capture(step=5, rank=0, world_size=1)
    sampler.set_epoch(1)
    reference = [(b.tolist(), torch.rand(1).item()) for b in loader]

    torch.manual_seed(7)
    sampler2, loader2 = make()
    state2 = lastgood.TrainState(loader=loader2)
    state2.apply(cap.json_state, lambda n, d: cap.tensors[n], lambda n: cap.tensors[n])
    sampler2.set_epoch(1)
    assert [(b.tolist(), torch.rand(1).item()) for b in loader2] == reference
