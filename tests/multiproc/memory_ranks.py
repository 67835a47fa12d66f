"""Rank script for the memory tier: `save URL RUN AGENT0,AGENT1`: step 1 durable (weights =
rank + 1), step 2 a memory checkpoint (rank + 10) into rank r's agent AGENTr;
`restore URL RUN AGENT0,AGENT1`: prints what each rank restored and from which copies."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import lastgood


def main() -> None:
    mode, url, run, agents = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Linear(8, 8)
    state = lastgood.TrainState(model=model)
    with lastgood.Checkpointer(url, run=run, memory=lastgood.Interval(every_steps=2), agent=agents[rank]) as ckpt:
        if mode == "save":
            for step, value in ((1, rank + 1.0), (2, rank + 10.0)):
                with torch.no_grad():
                    model.weight.fill_(value)
                ckpt.save(step, state, tier="memory" if step == 2 else "durable")
                ckpt.wait()
            print(f"[rank {rank}] memory {ckpt.memory.stats}", flush=True)
        else:
            step = ckpt.restore(state)
            print(f"[rank {rank}] restored step {step} weight {model.weight.flatten()[0].item()} "
                  f"reads {ckpt.restore_reads}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
