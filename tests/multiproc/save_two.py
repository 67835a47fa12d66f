"""Rank script: save step 1 (weights = rank + 1) and step 2 (weights = rank + 10)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import lastgood


def main() -> None:
    url, run = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Linear(8, 8)
    state = lastgood.TrainState(model=model)
    with lastgood.Checkpointer(url, run=run) as ckpt:
        for step, value in ((1, rank + 1.0), (2, rank + 10.0)):
            with torch.no_grad():
                model.weight.fill_(value)
            ckpt.save(step, state)
            ckpt.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
