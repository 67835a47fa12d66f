"""A tiny DeepSpeed training (CPU, gloo) saving through lastgood.integrations.deepspeed.

    deepspeed_train.py URL RUN OUT --stage N [--kill-at STEP]

Trains 8 steps with ZeRO stage N, AdamW and a WarmupLR schedule, saving with
engine.save_checkpoint every 3 steps and resuming through engine.load_checkpoint(dir,
tag="last-good"). Each rank writes its final (gathered) weights and its fp32 optimizer
partition to OUT/final-rank<r>.safetensors. `--kill-at`: every rank SIGKILLs itself after
that step (a save in flight at that moment is never closed).
"""

from __future__ import annotations

import argparse
import os
import signal

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from lastgood.integrations.deepspeed import attach  # noqa: E402

STEPS, EVERY = 8, 3

p = argparse.ArgumentParser()
p.add_argument("url")
p.add_argument("run")
p.add_argument("out")
p.add_argument("--stage", type=int, default=1)
p.add_argument("--kill-at", type=int)
a = p.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
          "zero_optimization": {"stage": a.stage}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
ds_ckpt = attach(engine, a.url, run=a.run, heartbeat_seconds=0)
rank = engine.global_rank
path, client = engine.load_checkpoint(os.path.join(a.out, "ds"), tag="last-good")
print(f"rank {rank} resumed from {path} at step {engine.global_steps} client {client}", flush=True)

while engine.global_steps < STEPS:
    g = torch.Generator().manual_seed(1000 * engine.global_steps + rank)  # the data of this step and rank
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    loss = ((engine(x) - y) ** 2).mean()  # dropout draws from the global RNG, which lastgood restores
    engine.backward(loss)
    engine.step()
    if engine.global_steps % EVERY == 0 or engine.global_steps == STEPS:
        engine.save_checkpoint(os.path.join(a.out, "ds"), client_state={"epoch": 0, "note": "tiny"})
    if a.kill_at is not None and engine.global_steps == a.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

params = list(engine.module.parameters())
with deepspeed.zero.GatheredParameters(params):  # ZeRO-3: the whole weights; else nothing to gather
    tensors = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
opt = engine.optimizer
parts = getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_partitioned_groups_flat", [])
tensors.update({f"fp32.{i}": t.detach().clone() for i, t in enumerate(parts)})
for i, state in enumerate(opt.optimizer.state.values()):
    tensors.update({f"adam.{i}.{k}": v.clone() for k, v in state.items() if torch.is_tensor(v)})
os.makedirs(a.out, exist_ok=True)
save_file(tensors, os.path.join(a.out, f"final-rank{rank}.safetensors"))
ds_ckpt.close()
print(f"rank {rank} done at step {engine.global_steps} loss {loss.item()!r}", flush=True)
