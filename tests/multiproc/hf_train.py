"""A tiny Hugging Face Trainer run (a 2-layer GPT-2 from a config, random init, dropout,
AdamW, a linear warmup schedule, a shuffled synthetic dataset over two epochs).

    hf_train.py URL RUN OUT [--kill-at STEP] [--native] [--noisy] [--save-steps N] [--accumulate N] [--workers N]

Trains 12 steps, saving every 3, through LastgoodTrainer, resuming with
train(resume_from_checkpoint=trainer.resume()); `--native`: the stock Trainer, saving its
own checkpoint folders and resuming with resume_from_checkpoint=True (when it has one).
Writes the final weights and the optimizer's moments to OUT/final.safetensors (the
Trainer's output_dir is OUT/hf; save_model() writes OUT/hf/final). `--noisy`: a collator
that draws from the global RNG. `--kill-at`: SIGKILLs itself after that step, once the
saves so far committed (or were written, --native). Runs alone or under torchrun (DDP):
rank R>0 writes OUT/final-rankR.safetensors.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from lastgood.integrations.hf import LastgoodTrainer


def noisy_collate(rows: list[dict]) -> dict:
    """Replaces a random tenth of the input tokens with token 0, drawing from the global
    torch RNG (as masking and augmenting collators do)."""
    ids = torch.stack([r["input_ids"] for r in rows])
    noisy = ids.masked_fill(torch.rand(ids.shape) < 0.1, 0)
    return {"input_ids": noisy, "labels": ids}


class KillAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            if isinstance(self.trainer, LastgoodTrainer) and args.process_index == 0:
                self.trainer.checkpointer.wait()  # the saves so far committed: the resume is mid-epoch
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # under torchrun: no rank dies before rank 0's saves are done
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("run")
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--native", action="store_true")
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--noisy", action="store_true", help="a collator that draws from the global RNG")
    a = p.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (32, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]  # 8 steps an epoch
    args = TrainingArguments(output_dir=str(a.out / "hf"), max_steps=12, per_device_train_batch_size=4,
                             learning_rate=1e-3, warmup_steps=4, save_strategy="steps", save_steps=a.save_steps,
                             logging_steps=100, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=a.workers,
                             gradient_accumulation_steps=a.accumulate,
                             disable_tqdm=True)
    callbacks = [KillAt(a.kill_at)] if a.kill_at else []
    common = {"model": model, "args": args, "train_dataset": data, "callbacks": callbacks,
              "data_collator": noisy_collate if a.noisy else None}
    if a.native:
        trainer = Trainer(**common)
        resume = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    else:
        trainer = LastgoodTrainer(**common, lastgood_url=a.url, lastgood_run=a.run)
        resume = trainer.resume()
    for cb in callbacks:
        cb.trainer = trainer
    print(f"resume from {resume}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.optimizer.state_dict()["state"]
    moments = {f"opt.{i}.{k}": v for i, s in opt.items() for k, v in s.items() if torch.is_tensor(v)}
    weights = {f"model.{k}": v.contiguous() for k, v in trainer.model.state_dict().items() if k != "lm_head.weight"}
    rank = args.process_index  # under torchrun: rank R>0 writes final-rankR.safetensors
    save_file({**weights, **moments}, str(a.out / ("final.safetensors" if rank == 0 else f"final-rank{rank}.safetensors")))
    trainer.save_model(str(a.out / "hf" / "final"))  # safetensors and JSON through LastgoodTrainer
    print(f"done at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
