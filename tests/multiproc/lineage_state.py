"""The training state the corruption matrix saves and checks: fixed by (step, rank) alone.

Step s on rank r sets the weights and the gradients from a generator seeded with (s, r)
and takes one SGD step with momentum, so the momentum buffers carry every earlier step;
the global RNG is seeded with (s, r) last. Restoring step s must reproduce build(r, s)
bit for bit: weights, momentum and RNG.
"""

from __future__ import annotations

import torch
from torch import nn


def seed(step: int, rank: int) -> int:
    return 1000 * step + rank


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(16, 16)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def advance(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(seed(step, rank))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
            p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    torch.manual_seed(seed(step, rank))


def build(rank: int, upto: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt = make()
    for step in range(1, upto + 1):
        advance(model, opt, step, rank)
    return model, opt


def same(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]) -> bool:
    """Bitwise equal weights and optimizer moments."""
    (ma, oa), (mb, ob) = a, b
    sa, sb = ma.state_dict(), mb.state_dict()
    if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
        return False
    qa, qb = oa.state_dict()["state"], ob.state_dict()["state"]
    return qa.keys() == qb.keys() and all(
        torch.equal(qa[i]["momentum_buffer"], qb[i]["momentum_buffer"]) for i in qa)
