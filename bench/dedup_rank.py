"""One rank of bench/dedup.py: a DDP stack of Linear(dim, dim) with AdamW after one step,
saved once through the Checkpointer (LASTGOOD_DEDUP decides whether its replicated state
is written once) or through DCP's StorageWriter (DCP's planner dedups).

    python -m bench.dedup_rank MODE URL RUN OUT LAYERS DIM     MODE: checkpointer | dcp

Writes OUT/<mode>-rank<R>.json: the rank's state bytes (weights and moments) and the time
from save() to the acknowledged commit.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lastgood


def main() -> None:
    mode, url, run, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    layers, dim = int(sys.argv[5]), int(sys.argv[6])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers))))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    torch.manual_seed(1 + rank)
    ddp(torch.randn(4, dim)).square().mean().backward()
    opt.step()
    state_bytes = sum(t.numel() * t.element_size() for t in ddp.parameters())
    state_bytes += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    if mode == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from lastgood import dcp as lgdcp

        writer = lgdcp.StorageWriter(url, run=run)
        dist.barrier()
        began = time.perf_counter()
        msd, osd = get_state_dict(ddp, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer, checkpoint_id="1", planner=lgdcp.SavePlanner())
        took = time.perf_counter() - began
    else:
        with lastgood.Checkpointer(url, run=run, heartbeat_seconds=0) as ckpt:
            state = lastgood.TrainState(model=ddp, optimizer=opt)
            dist.barrier()
            began = time.perf_counter()
            ckpt.save(1, state)
            ckpt.wait()
            took = time.perf_counter() - began
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps({"rank": rank, "state_bytes": state_bytes,
                                                             "save_s": took}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
