"""Training ranks for the memory tier's node-failure scenarios (tests/agent/test_netns_torchrun.py),
one rank a node, launched by torchrun in each node's namespace over a multi-node rendezvous.

A small model trained with AdamW and dropout (the RNG is part of the state) on a batch drawn
from the step and the rank (the data cursor is the step); the gradients all-reduced over gloo.
A memory checkpoint every MEMORY_EVERY steps into the node's agent (LASTGOOD_AGENT, set by the
test), a durable one every DURABLE_EVERY steps.

    train OUT [HANG_AFTER]   restore the run's last-good (none on a new run), then train to FINAL;
                             with HANG_AFTER, once step HANG_AFTER is done and every save before it
                             has ended, write OUT/hung-rank<R>.json and wait to be killed
    reference OUT            the same steps with no Checkpointer

Each rank that finishes writes OUT/<phase>-rank<R>.json: the step restored, what the restore
read, and the sha256 of the final weights and optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lastgood

FINAL, MEMORY_EVERY, DURABLE_EVERY = 12, 2, 5


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


def fingerprint(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    tensors = [*model.state_dict().values(),
               *(v for st in opt.state_dict()["state"].values() for v in st.values() if torch.is_tensor(v))]
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    phase, out = sys.argv[1], Path(sys.argv[2])
    hang_after = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = lastgood.TrainState(model=model, optimizer=opt)
    ck = None
    if phase == "train":
        ck = lastgood.Checkpointer(interval=lastgood.Interval(every_steps=DURABLE_EVERY),
                                   memory=lastgood.Interval(every_steps=MEMORY_EVERY))
    restored = (ck.restore(state) or 0) if ck is not None else 0
    reads = ck.restore_reads if ck is not None else None
    for step in range(restored + 1, FINAL + 1):
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if ck is not None and ck.due(step):
            ck.save(step, state)
        if step == hang_after:
            ck.wait()
            (out / f"hung-rank{rank}.json").write_text(json.dumps({"step": step, "memory": ck.memory.stats}))
            while True:  # a node fails under it, or its torchrun group is killed
                time.sleep(1)
    memory = None
    if ck is not None:
        ck.wait()
        memory = ck.memory.stats
        ck.close()
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps({
        "restored": restored, "reads": reads, "memory": memory, "fingerprint": fingerprint(model, opt)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1] / "multiproc"))
    from rank_exit import run  # leave without interpreter finalization (gloo's worker threads: see there)

    run(main)
