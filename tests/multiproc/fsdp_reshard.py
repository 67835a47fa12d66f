"""Rank script: an FSDP2 model with AdamW, saved on one world size, restored on another.

    save    URL RUN OUT        train 3 steps on a plain DataLoader over ResumableDistributedSampler,
                               save steps 1 and 2
    restore URL RUN OUT [STEP] a fresh, differently initialised model: restore (expecting STEP,
                               default 2), then finish the epoch; STEP 0: expect NoUsableCheckpoint
                               and print the size of the optimizer's state

`--agents A0,A1,..` (either phase): the memory tier (docs/memory-tier.md): step 2 is saved as
a memory checkpoint into rank r's agent A(r mod n), and restore reads it from the agents.

Both write OUT/full-<phase>.safetensors (rank 0: every full tensor, weights and Adam
moments, gathered with full_state_dict) and OUT/ids-<phase>-rank<R>.json (samples seen);
restore also OUT/read-rank<R>.json: the shard bytes and ranged requests its transport
received, what the read plan says it read (Checkpointer.restore_reads), and the bytes of
its own new shards (every DTensor's local shard).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import lastgood


IN = 1024  # layer 0's weight: 120 KiB, several 4 KiB range-digest blocks per stored shard


class Points(torch.utils.data.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return i, torch.randn(IN, generator=g)


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, 30), nn.ReLU(), nn.Linear(30, 7))  # 30 and 7 split unevenly
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sampler = lastgood.ResumableDistributedSampler(Points(), shuffle=True, seed=5)
    loader = DataLoader(Points(), batch_size=2, sampler=sampler)
    return model, opt, sampler, loader


def dump_full(model, opt, out: Path, phase: str) -> None:
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, opt, options=full)
    if dist.get_rank() == 0:
        tensors = {f"model.{k}": v.contiguous() for k, v in msd.items()}
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                tensors[f"optim.{fqn}.{k}"] = v.contiguous() if v.dim() else v.reshape(1)
        save_file(tensors, str(out / f"full-{phase}.safetensors"))


def local_bytes(model, opt) -> int:
    """The bytes of this rank's own shards: every DTensor's local shard, weights and moments."""
    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
    values = [*msd.values(), *(v for st in osd["state"].values() for v in st.values())]
    return sum(v.to_local().numel() * v.element_size() for v in values if hasattr(v, "to_local"))


def main() -> None:
    argv = list(sys.argv)
    agents = argv.pop(argv.index("--agents") + 1).split(",") if "--agents" in argv else []
    argv = [a for a in argv if a != "--agents"]
    phase, url, run, out = argv[1], argv[2], argv[3], Path(argv[4])
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt, sampler, loader = build(seed=0 if phase == "save" else 1)
    state = lastgood.TrainState(model=model, optimizer=opt, loader=loader)
    seen = []
    tier = {"memory": lastgood.Interval(every_steps=2), "agent": agents[rank % len(agents)]} if agents else {}
    with lastgood.Checkpointer(url, run=run, **tier) as ckpt:
        if phase == "save":
            sampler.set_epoch(0)
            for step, (ids, x) in zip(range(3), loader):
                loss = model(x).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen += ids.tolist()
                if step == 1:
                    ckpt.save(1, state)  # the ancestor a damaged step 2 falls back to
            ckpt.save(2, state, tier="memory" if agents else None)
            ckpt.wait()
            if agents:
                assert ckpt.memory.stats["memory_committed"] == 1, ckpt.memory.stats
        else:
            want = int(argv[5]) if len(argv) > 5 else 2
            if want == 0:  # every checkpoint damaged: nothing restored, nothing changed
                try:
                    ckpt.restore(state)
                except lastgood.NoUsableCheckpoint:
                    print(f"[rank {rank}] no usable checkpoint; optimizer state: {len(opt.state)}", flush=True)
                    dist.barrier()
                    dist.destroy_process_group()
                    return
                raise AssertionError("restored a damaged checkpoint")
            got = ckpt.restore(state)
            assert got == want, f"restored step {got}, expected {want}"
            print(f"[rank {rank}] restored step {got}", flush=True)
            (out / f"read-rank{rank}.json").write_text(json.dumps({
                "shard_bytes": ckpt.transport.shard_bytes, "requests": ckpt.transport.range_requests,
                "lent": ckpt.transport.lent_ranges, "reads": ckpt.restore_reads,
                "new_shard_bytes": local_bytes(model, opt)}))
            sampler.set_epoch(0)
            for ids, _ in loader:  # the rest of epoch 0, dealt to the new ranks
                seen += ids.tolist()
    dump_full(model, opt, out, phase)
    (out / f"ids-{phase}-rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
