"""torchtitan's dataloader state through LastgoodCheckpointManager (#37), in process: the
ParallelAwareDataloader pickles its own state; LoaderState stores it as typed JSON text
(the shuffling sampler's RNG tensor included), resumes the loader exactly, and refuses a
pickled state (torchtitan's own format) without unpickling it, where the stock loader runs
whatever the pickle holds (the control)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

import torchtitan  # noqa: F401  (pinned in requirements-dev.txt: a missing install fails, never skips)

from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402

from lastgood.errors import LastgoodError  # noqa: E402
from lastgood.integrations.torchtitan import LoaderState  # noqa: E402

RAN: list[str] = []


def _ran(what: str) -> None:
    RAN.append(what)


class Hostile:
    def __reduce__(self):  # unpickling it calls _ran: what any pickle may do
        return (_ran, ("unpickled",))


def _loader(world: int = 1) -> ParallelAwareDataloader:
    data = torch.utils.data.TensorDataset(torch.arange(64.0).reshape(32, 2))
    return ParallelAwareDataloader(data, dp_rank=0, dp_world_size=world, batch_size=4, shuffle=True,
                                   generator=torch.Generator().manual_seed(7))


def test_the_loader_state_is_json_and_resumes_the_shuffled_order_exactly():
    first = _loader()
    it = iter(first)
    for _ in range(3):
        next(it)
    saved = LoaderState(first).state_dict()
    doc = json.loads(saved["dp_rank_0"])  # one JSON text, no pickle
    assert saved["world_size"] == 1 and doc["arrays"], doc  # the sampler's RNG state, inline
    want = [b[0] for b in it]

    again = _loader()
    LoaderState(again).load_state_dict(saved)
    got = [b[0] for b in iter(again)]
    assert len(got) == len(want) == 5 and all(g.equal(w) for g, w in zip(got, want))
    fresh = [b[0] for b in iter(_loader())]  # control: without the state the order starts over
    assert not fresh[0].equal(got[0])


def test_a_pickled_loader_state_is_refused_unread_where_torchtitan_unpickles_it():
    hostile = {"dp_rank_0": pickle.dumps(Hostile()), "world_size": 1}
    RAN.clear()
    try:
        _loader().load_state_dict(hostile)  # control: torchtitan's own loader runs the pickle
    except Exception:  # noqa: BLE001 - what it does with the result does not matter here
        pass
    assert RAN == ["unpickled"]

    RAN.clear()
    with pytest.raises(LastgoodError, match="not a dataloader state written by LastgoodCheckpointManager"):
        LoaderState(_loader()).load_state_dict(hostile)
    assert RAN == []


def test_another_data_parallel_world_is_refused_with_both_counts():
    saved = LoaderState(_loader(world=2)).state_dict()
    with pytest.raises(LastgoodError, match="saved with 2 data-parallel ranks and runs with 1"):
        LoaderState(_loader()).load_state_dict(saved)
