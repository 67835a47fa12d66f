"""One rank of bench/reshard.py (run by torchrun): an FSDP2 stack of Linear layers with
AdamW (moments filled by one step), saved, or restored with its own figures measured.

    save    URL RUN OUT LAYERS DIM
    restore URL RUN OUT LAYERS DIM     writes OUT/rank<R>.json

The restore's peak extra memory: VmHWM is reset (/proc/self/clear_refs, 5) just before
restore() and read after it, less the VmRSS before: what restore() added at its peak."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import lastgood


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def build(layers: int, dim: int, seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, dim)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def local_bytes(model, opt) -> int:
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    values = [*msd.values(), *(v for st in osd["state"].values() for v in st.values())]
    return sum(v.to_local().numel() * v.element_size() for v in values if hasattr(v, "to_local"))


def main() -> None:
    phase, url, run, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    layers, dim = int(sys.argv[5]), int(sys.argv[6])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build(layers, dim, seed=0 if phase == "save" else 1)
    state = lastgood.TrainState(model=model, optimizer=opt)
    with lastgood.Checkpointer(url, run=run, heartbeat_seconds=0) as ckpt:
        if phase == "save":
            ckpt.save(1, state)
            ckpt.wait()
        else:
            dist.barrier()
            rss = status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            t0 = time.perf_counter()
            ckpt.restore(state)
            took = time.perf_counter() - t0
            hwm = status("VmHWM")
            reads = ckpt.restore_reads or {"bytes": ckpt.transport.shard_bytes, "requests": 0}
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.json").write_text(json.dumps({
                "rank": rank, "restore_s": took, "rss_before": rss, "peak_extra": hwm - rss,
                "new_shard_bytes": local_bytes(model, opt), "reads": reads}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
