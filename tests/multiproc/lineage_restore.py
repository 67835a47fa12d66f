"""Rank script: the relaunch. For each RUN[:how] on the command line, restore into a
fresh model and optimizer and write one line to OUT/results-rank<R>.txt (a file per rank:
the ranks' stdout lines may interleave):

    <RUN[:how]> <step|None|refused:<error type>> <bitwise|differs|->

`bitwise`: weights, momentum and RNG are exactly lineage_state's at the restored step.
`:stream` reads the shards as a gRPC stream instead of a link in the service's spool; any
other `:how` only tells two restores of one run apart."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import lastgood
from lineage_state import build, make, same, seed


def main() -> None:
    url, out, runs = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    for spec in runs:
        run, _, how = spec.partition(":")
        os.environ["LASTGOOD_USE_SPOOL"] = "0" if how == "stream" else "1"
        model, opt = make()
        try:
            with lastgood.Checkpointer(url, run=run) as ckpt:
                step = ckpt.restore(lastgood.TrainState(model=model, optimizer=opt))
        except Exception as e:  # noqa: BLE001 - reported, and the next run goes on
            print(f"[rank {rank}] {run}: {type(e).__name__}: {e}", flush=True)
            results.append(f"{spec} refused:{type(e).__name__} -")
            continue
        if step is None:
            results.append(f"{spec} None -")
            continue
        rng = torch.get_rng_state()
        exact = torch.equal(rng, torch.manual_seed(seed(step, rank)).get_state()) and same((model, opt),
                                                                                          build(rank, step))
        results.append(f"{spec} {step} {'bitwise' if exact else 'differs'}")
    (out / f"results-rank{rank}.txt").write_text("".join(line + "\n" for line in results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
