"""Rank script: in each run named on the command line, save steps 1..STEPS of lineage_state."""

from __future__ import annotations

import sys

import torch.distributed as dist

import lastgood
from lineage_state import advance, make

STEPS = 3


def main() -> None:
    url, runs = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for run in runs:
        model, opt = make()
        state = lastgood.TrainState(model=model, optimizer=opt)
        with lastgood.Checkpointer(url, run=run) as ckpt:
            for step in range(1, STEPS + 1):
                advance(model, opt, step, rank)
                ckpt.save(step, state)
            ckpt.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
