"""Rank script: a DDP model with AdamW, a scheduler and a BatchNorm, its replicated state
written once (lastgood/restore/replicas.py), restored at the same or another world size.

    save    URL RUN OUT         train 3 steps, each rank on its own batches; save steps 1 and 2
    restore URL RUN OUT [STEP]  a fresh, differently initialised model: restore (expecting
                                STEP, default 2)
    fenced  URL RUN OUT         rank 1 is fenced (as a refused upload leaves it), the others do
                                not know yet; every rank saves once and writes what it raised
                                to OUT/fenced-rank<R>.txt

Both write OUT/<phase>-rank<R>.safetensors: the rank's module state (weights, and the
BatchNorm's running statistics, which differ per rank), its optimizer state by parameter
name, its torch RNG state, and OUT/<phase>-rank<R>.json: its scheduler state. LASTGOOD_DEDUP=0
in the environment writes every rank's state in full (the control).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import lastgood

WIDTH = 256  # 4 weights of 256 KiB, with Adam's two moments: ~3 MiB replicated in 12 big tensors


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                          nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return ddp, opt, sched


def dump(ddp, opt, sched, out: Path, phase: str, rank: int) -> None:
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in ddp.module.state_dict().items()}
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            tensors[f"optim.{names[id(p)]}.{k}"] = v.detach().clone().reshape(-1)
    tensors["rng"] = torch.get_rng_state()
    save_file(tensors, str(out / f"{phase}-rank{rank}.safetensors"))
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps(sched.state_dict()))


def fenced(url: str, run: str, out: Path, rank: int) -> None:
    ddp, opt, sched = build(seed=0)
    ddp(torch.randn(4, WIDTH)).sum().backward()
    opt.step()
    ckpt = lastgood.Checkpointer(url, run=run)
    if rank == 1:  # what _run sets when the service refuses this launch's upload
        ckpt._fenced = lastgood.Fenced("run: this launch is fenced by a newer launch")
    try:
        ckpt.save(1, lastgood.TrainState(model=ddp, optimizer=opt, scheduler=sched))
        got = "saved"
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        got = type(e).__name__
    (out / f"fenced-rank{rank}.txt").write_text(got)
    print(f"[rank {rank}] {got}", flush=True)
    os._exit(0)  # a fenced launch stops here; its peers' state does not matter


def main() -> None:
    phase, url, run, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if phase == "fenced":
        return fenced(url, run, out, rank)
    ddp, opt, sched = build(seed=0 if phase == "save" else 1)
    torch.manual_seed(100 + rank)  # each rank's own RNG stream: per-rank state
    state = lastgood.TrainState(model=ddp, optimizer=opt, scheduler=sched)
    with lastgood.Checkpointer(url, run=run) as ckpt:
        if phase == "save":
            for step in range(3):
                x = torch.randn(16, WIDTH)  # this rank's own batch
                loss = ddp(x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                if step >= 1:
                    ckpt.save(step, state)  # step 1: the ancestor a damaged step 2 falls back to
            ckpt.wait()
            print(f"[rank {rank}] saved", flush=True)
        else:
            want = int(sys.argv[5]) if len(sys.argv) > 5 else 2
            got = ckpt.restore(state)
            assert got == want, f"restored step {got}, expected {want}"
            print(f"[rank {rank}] restored step {got}", flush=True)
    dump(ddp, opt, sched, out, phase, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
