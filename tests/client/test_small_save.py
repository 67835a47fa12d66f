"""A small state's save is two service calls, begin and vote: its files travel with the vote
(CommitRank.inline_files, up to the service's GET /api/v1/info: inline_bytes), through the
Checkpointer and through lastgood's DCP writer alike, and restores bitwise. Control: against
a service that takes no file with a vote (LASTGOOD_INLINE_BYTES=0) the same save hands its
files over one call each, as before."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lastgood
from lastgood import dcp as lgdcp

WATCHED = ("begin", "put_shard", "put_followed", "commit_rank", "outcome")


def calls_of(transport) -> list[str]:
    """The service calls of the save path one transport makes, in order (its methods wrapped)."""
    seen: list[str] = []
    for name in WATCHED:
        real = getattr(transport, name)

        def watched(*a, _name=name, _real=real, **kw):
            seen.append(_name)
            return _real(*a, **kw)
        setattr(transport, name, watched)
    return seen


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("inline", [True, False], ids=["with-the-vote", "control-inline-off"])
def test_a_tiny_checkpointer_save_is_begin_and_vote(service, make_service, run_name, inline):
    svc = service if inline else make_service(LASTGOOD_INLINE_BYTES="0")
    model, opt = _model()
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        seen = calls_of(ckpt.transport)
        ckpt.save(1, lastgood.TrainState(model=model, optimizer=opt))
        ckpt.wait()
    if inline:
        assert seen == ["begin", "commit_rank"], seen
    else:
        assert seen[0] == "begin" and seen[-1] == "commit_rank" and {"put_shard", "put_followed"} & set(seen), seen
    other = torch.nn.Linear(64, 64)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    with lastgood.Checkpointer(svc.url, run=run_name) as ckpt:
        assert ckpt.restore(lastgood.TrainState(model=other, optimizer=other_opt)) == 1
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_tiny_dcp_save_is_begin_and_vote(service, run_name):
    model, _ = _model()
    writer = lgdcp.StorageWriter(service.url, run=run_name)
    seen = calls_of(writer.transport)
    dcp.save({"model": model.state_dict()}, storage_writer=writer, checkpoint_id="1", planner=lgdcp.SavePlanner())
    assert seen == ["begin", "commit_rank"], seen  # the shard and DCP's metadata both carried by the vote
    back = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(back, storage_reader=lgdcp.StorageReader(service.url, run=run_name), planner=lgdcp.LoadPlanner())
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
