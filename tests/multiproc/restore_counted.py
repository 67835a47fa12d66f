"""Rank script: restore the run's last-good and write what metadata this rank fetched
(RestClient.fetched: path -> times, and the bytes) to DIR/fetched-rank<R>.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lastgood


def main() -> None:
    url, run, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Linear(8, 8)
    with torch.no_grad():
        model.weight.fill_(-1.0)
    with lastgood.Checkpointer(url, run=run) as ckpt:
        step = ckpt.restore(lastgood.TrainState(model=model))
        t = ckpt.transport
        (out / f"fetched-rank{rank}.json").write_text(json.dumps({"paths": t.fetched, "bytes": t.fetched_bytes}))
    print(f"[rank {rank}] restored step {step} weight {model.weight[0, 0].item()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
