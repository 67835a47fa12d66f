"""Rank script: the relaunch. For each RUN[:stream] on the command line, restore into a
fresh model and optimizer and print one line per rank:

    RESULT <run> <step|None|refused:<error type>> <bitwise|differs|->

`bitwise`: weights, momentum and RNG are exactly lineage_state's at the restored step.
`:stream` reads the shards as a gRPC stream instead of a link in the service's spool."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import lastgood
from lineage_state import build, make, same, seed


def main() -> None:
    url, runs = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for spec in runs:
        run, _, how = spec.partition(":")
        os.environ["LASTGOOD_SPOOL"] = "0" if how == "stream" else "1"
        model, opt = make()
        try:
            with lastgood.Checkpointer(url, run=run) as ckpt:
                step = ckpt.restore(lastgood.TrainState(model=model, optimizer=opt))
        except Exception as e:  # noqa: BLE001 - reported, and the next run goes on
            print(f"[rank {rank}] {run}: {type(e).__name__}: {e}", flush=True)
            print(f"[rank {rank}] RESULT {run} refused:{type(e).__name__} -", flush=True)
            continue
        if step is None:
            print(f"[rank {rank}] RESULT {run} None -", flush=True)
            continue
        rng = torch.get_rng_state()
        exact = torch.equal(rng, torch.manual_seed(seed(step, rank)).get_state()) and same((model, opt),
                                                                                          build(rank, step))
        print(f"[rank {rank}] RESULT {run} {step} {'bitwise' if exact else 'differs'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
