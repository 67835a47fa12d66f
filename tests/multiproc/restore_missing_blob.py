"""Rank script: restore when rank 1's blob of the newest checkpoint is gone. Every rank
must fall back to the previous checkpoint together (no rank may wait on another)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import lastgood


def main() -> None:
    url, run = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    model = nn.Linear(8, 8)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    with lastgood.Checkpointer(url, run=run) as ckpt:
        step = ckpt.restore(lastgood.TrainState(model=model))
    print(f"[rank {dist.get_rank()}] restored step {step} weight {model.weight[0, 0].item()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
