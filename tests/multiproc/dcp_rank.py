"""Rank script for DCP through lastgood.

    sync|async URL RUN [OUT]  save (or async_save) an FSDP2 model + AdamW state, load it into a
                           fresh one, print whether every value came back exactly; rank 0
                           writes the full state saved to OUT/want.pt if OUT is given
    pickle URL RUN         save with DCP's default planner: must be refused
    die URL RUN            rank 1 dies inside write_data: nothing may become visible
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lastgood import dcp as lgdcp


def build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def full(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return msd, osd


def main() -> None:
    mode, url, run = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build(0)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "meta": {"epoch": 3, "tokens": 123456789, "name": "x"}}
    writer = lgdcp.StorageWriter(url, run=run)
    if mode == "pickle":
        try:
            dcp.save(state, storage_writer=writer, checkpoint_id="5")  # DCP's default, pickling planner
            print(f"[rank {rank}] saved with pickles?!", flush=True)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            print(f"[rank {rank}] refused: {type(e).__name__}: {'pickled this value' in str(e)}", flush=True)
        dist.destroy_process_group()
        return
    if mode == "die":
        if rank == 1:
            original = lgdcp.StorageWriter.write_data

            def dying(self, plan, planner):
                os.kill(os.getpid(), signal.SIGKILL)
                return original(self, plan, planner)

            lgdcp.StorageWriter.write_data = dying
        dcp.save(state, storage_writer=writer, checkpoint_id="5", planner=lgdcp.SavePlanner())
        return
    if mode == "async":
        dcp.async_save(state, storage_writer=writer, checkpoint_id="5", planner=lgdcp.SavePlanner()).result()
    else:
        dcp.save(state, storage_writer=writer, checkpoint_id="5", planner=lgdcp.SavePlanner())
    want_m, want_o = full(model, opt)
    if len(sys.argv) > 4 and rank == 0:
        torch.save({"model": want_m, "optim": want_o}, os.path.join(sys.argv[4], "want.pt"))

    model2, opt2 = build(1)
    msd2, osd2 = get_state_dict(model2, opt2)
    state2 = {"model": msd2, "optim": osd2, "meta": {"epoch": 0, "tokens": 0, "name": ""}}
    dcp.load(state2, storage_reader=lgdcp.StorageReader(url, run=run), planner=lgdcp.LoadPlanner())
    set_state_dict(model2, opt2, model_state_dict=state2["model"], optim_state_dict=state2["optim"])
    got_m, got_o = full(model2, opt2)
    if rank != 0:  # full state dicts with cpu_offload are gathered on rank 0 only
        print(f"[rank {rank}] loaded meta {state2['meta']}", flush=True)
        dist.destroy_process_group()
        return
    same_m = all(torch.equal(want_m[k], got_m[k]) for k in want_m)
    same_o = all(torch.equal(want_o["state"][p][k], got_o["state"][p][k])
                 for p in want_o["state"] for k in want_o["state"][p])
    same_g = want_o["param_groups"] == got_o["param_groups"]
    print(f"[rank {rank}] model {same_m} optim {same_o} groups {same_g} meta {state2['meta']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
