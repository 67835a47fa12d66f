"""Rank 0 alone creates a collective Checkpointer (it must raise within LASTGOOD_JOIN_SECONDS,
not hang); then every rank creates a solo one: rank 0 saves, every rank restores."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import lastgood


def main() -> None:
    dist.init_process_group("gloo")
    url, run = sys.argv[1:3]
    rank = dist.get_rank()
    if rank == 0:
        began = time.monotonic()
        try:
            lastgood.Checkpointer(url, run=run, heartbeat_seconds=0)
            print("rank 0 created it alone", flush=True)
        except lastgood.LastgoodError as e:
            print(f"rank 0 refused after {time.monotonic() - began:.1f} s: {e}", flush=True)
    torch.manual_seed(rank)  # different weights on each rank until the restore
    model = nn.Linear(3, 3)
    ckpt = lastgood.Checkpointer(url, run=run, solo=True, heartbeat_seconds=0)
    if rank == 0:
        with torch.no_grad():
            model.weight.fill_(3.0)
        ckpt.save(5, lastgood.TrainState(model=model))
        ckpt.wait()
    else:
        try:
            ckpt.save(5, lastgood.TrainState(model=model))
        except lastgood.LastgoodError as e:
            print(f"rank {rank} save refused: {e}", flush=True)
    dist.barrier()
    step = ckpt.restore(lastgood.TrainState(model=model))
    ckpt.close()
    print(f"rank {rank} restored step {step} weight {float(model.weight.sum())}", flush=True)


if __name__ == "__main__":
    from rank_exit import run as run_main  # this folder is on sys.path: torchrun runs the script by its path

    run_main(main)
