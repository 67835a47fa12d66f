"""Rank script for test_directfs.py: a tiny DDP model trained a few steps, saved through
direct-FS (the environment names the mount and turns the spool off), or restored and
compared bit for bit with the state the save wrote (each rank's tensors in a file)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

import lastgood
from lastgood.datapath import directfs


def build():
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def flat(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.detach().clone().contiguous() for k, v in s.items()})
    return out


def main() -> None:
    url, run, mode, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build()
    state = lastgood.TrainState(model=model, optimizer=opt)
    with lastgood.Checkpointer(url, run=run) as ckpt:
        assert directfs.of(ckpt.transport) is not None and ckpt.transport.spool is None, "direct-FS, no spool"
        if mode == "save":
            torch.manual_seed(100 + rank)
            for _ in range(3):
                model(torch.randn(8, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            ckpt.save(3, state)
            ckpt.wait()
            save_file(flat(model, opt), str(out / f"saved-rank{rank}.safetensors"))
        else:
            assert ckpt.restore(state) == 3
            want = load_file(str(out / f"saved-rank{rank}.safetensors"))
            got = flat(model, opt)
            assert want.keys() == got.keys(), (sorted(want), sorted(got))
            bad = [k for k in want if not torch.equal(want[k], got[k])]
            assert not bad, f"rank {rank}: restored tensors differ: {bad}"
            print(f"[rank {rank}] restored bitwise", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
