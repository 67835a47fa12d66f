"""A tiny training with torchtitan's own components through LastgoodCheckpointManager.

    titan_train.py URL RUN OUT [--async-mode MODE] [--kill-at STEP] [--steps N]

torchtitan's Trainer needs CUDA and its model registry needs triton, neither of which a
CPU machine has (docs/integrations/torchtitan.md), so this script is the Trainer's loop
(Trainer.train and train_step, in their order) over torchtitan's components:
OptimizersContainer, LRSchedulersContainer, ParallelAwareDataloader (shuffled), the
checkpoint manager built from its Config as the Trainer builds it, and the Trainer's train
state. Two ranks shard the model with FSDP2 (fully_shard, as torchtitan does). Saves every
3 steps; resumes through the manager's load() on start. Each rank writes its final weights
and optimizer state to OUT/final-rank<r>.safetensors. `--kill-at`: every rank SIGKILLs
itself after that step's save; `--load-step`, `--last-model-only`: the checkpoint
section's load_step and last_save_model_only; `--retention`: the run's policy; `--then-load
S,...`: after the start's load, load(step=S) for each S in turn (a refusal is printed), then
train on from the last one loaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from lastgood.errors import LastgoodError
from lastgood.integrations.torchtitan import LastgoodCheckpointManager


class TrainState:
    """What torchtitan's Trainer saves of itself (Trainer.state_dict)."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("run")
    p.add_argument("out", type=Path)
    p.add_argument("--async-mode", default="disabled")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--load-step", type=int, default=-1)
    p.add_argument("--last-model-only", action="store_true")
    p.add_argument("--retention")
    p.add_argument("--then-load", default="")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lastgood").setLevel(logging.INFO)  # which checkpoint the manager loads
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    if world > 1:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizers = default_adamw(lr=1e-2)
    optimizers.implementation = "foreach"  # "fused", torchtitan's default, is for CUDA
    optimizers = optimizers.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear") \
        .build(optimizers=optimizers, training_steps=a.steps)
    g = torch.Generator().manual_seed(1 + rank)  # each data-parallel rank its own data, as torchtitan splits it
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 8, generator=g))
    dataloader = ParallelAwareDataloader(data, dp_rank=rank, dp_world_size=world, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    train_state = TrainState()
    config = LastgoodCheckpointManager.Config(enable=True, interval=3, url=a.url, run=a.run,
                                              async_mode=a.async_mode, last_save_model_only=a.last_model_only,
                                              load_step=a.load_step, retention=a.retention)
    checkpointer = config.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train_state},
                                sd_adapter=None, base_folder=str(a.out))

    resumed = checkpointer.load(step=config.load_step)
    print(f"rank {rank} resumed {resumed} at step {train_state.step}", flush=True)
    for step in (int(s) for s in a.then_load.split(",") if s):
        try:
            resumed = checkpointer.load(step=step)
        except LastgoodError as e:
            print(f"rank {rank} load_step {step} refused: {e}", flush=True)
            continue
        print(f"rank {rank} resumed {resumed} at step {train_state.step}", flush=True)
    batches = iter(dataloader)
    while train_state.step < a.steps:
        train_state.step += 1
        x, y = next(batches)
        loss = (model(x) - y).square().mean()
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += x.numel()
        checkpointer.save(train_state.step, last_step=train_state.step == a.steps)
        if train_state.step == a.kill_at:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.maybe_wait_for_saving()

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().contiguous()

    final = {f"model.{k}": local(v) for k, v in model.state_dict().items()}
    for i, opt in enumerate(optimizers.optimizers):
        final.update({f"opt.{i}.{j}.{k}": local(v) for j, s in enumerate(opt.state.values()) for k, v in s.items()})
    final["lr"] = torch.tensor(lr_schedulers.schedulers[0].get_last_lr())
    final["next_batch"] = next(batches)[0]  # the dataloader resumed where it stood
    a.out.mkdir(parents=True, exist_ok=True)
    save_file(final, str(a.out / f"final-rank{rank}.safetensors"))
    print(f"rank {rank} done at step {train_state.step}, {train_state.ntokens_seen} tokens", flush=True)
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
