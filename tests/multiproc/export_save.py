"""Rank script: a tiny Llama (transformers, random init from a config) trained a few steps
and saved through lastgood, for the export tests.

    export_save.py URL OUT FSDP_RUN [DDP_RUN]

FSDP_RUN: FSDP2 (each decoder layer and the whole model sharded over every rank), AdamW,
3 steps, saved at step 3 with the model's config in extra["hf_config"]. DDP_RUN (if
given): the same model under DistributedDataParallel, saved without a config. For each
run, rank 0 writes OUT/<run>-full.safetensors (every full weight, gathered with
full_state_dict) and OUT/<run>-logits.safetensors (the trained model's logits on a fixed
batch, computed by the sharded model itself).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import lastgood

# vocabulary 61: the embedding and the head split unevenly over 2 and 4 ranks
CONFIG = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
BATCH = torch.arange(2 * 12).reshape(2, 12) * 7 % 61  # the fixed batch of the logits check


def train_and_save(url: str, out: Path, run: str, kind: str) -> None:
    cfg = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
        loss = wrapped(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    extra = {"hf_config": cfg.to_dict()} if kind == "fsdp" else {}
    state = lastgood.TrainState(model=wrapped, optimizer=opt, extra=extra)
    with lastgood.Checkpointer(url, run=run) as ckpt:
        ckpt.save(3, state)
        ckpt.wait()
    model.eval()
    with torch.no_grad():
        logits = wrapped(input_ids=BATCH).logits
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / f"{run}-full.safetensors"))
        save_file({"logits": logits.contiguous()}, str(out / f"{run}-logits.safetensors"))
    dist.barrier()


def main() -> None:
    url, out, fsdp_run = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    train_and_save(url, out, fsdp_run, "fsdp")
    if len(sys.argv) > 4:
        train_and_save(url, out, sys.argv[4], "ddp")
    dist.destroy_process_group()


if __name__ == "__main__":
    from rank_exit import run  # this folder is on sys.path: torchrun runs the script by its path

    run(main)
