"""A tiny Accelerate training loop (an MLP with dropout, AdamW, a warmup schedule, gradient
accumulation over 2 batches, a shuffled StatefulDataLoader with Accelerate's seedable
sampler, a progress object given to register_for_checkpointing, every rank seeded apart).

    accelerate_train.py URL RUN OUT [--kill-at BATCH] [--native]

Trains 20 batches, saving every 4 through LastgoodAccelerator and resuming with
load_state(accelerator.resume()); `--native`: the stock Accelerator, save_state(folder) and
load_state(the newest folder) under OUT/native. Writes each rank's weights and optimizer
moments to OUT/final-rank{R}.safetensors. `--kill-at`: every rank SIGKILLs itself after
that batch, once the saves so far committed (or were written, --native). Runs alone or
under torchrun.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from lastgood.integrations.accelerate import LastgoodAccelerator

TOTAL, EVERY = 20, 4


class Progress:
    """The loop's own state, saved and loaded through register_for_checkpointing."""

    def __init__(self) -> None:
        self.batches, self.losses = 0, []

    def state_dict(self) -> dict:
        return {"batches": self.batches, "losses": list(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.batches, self.losses = state["batches"], list(state["losses"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("run")
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--native", action="store_true")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    config = {"cpu": True, "gradient_accumulation_steps": 2,
              "dataloader_config": DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)}
    acc = Accelerator(**config) if a.native else LastgoodAccelerator(**config, lastgood_url=a.url, lastgood_run=a.run)
    set_seed(0, device_specific=True)  # each rank its own dropout masks
    torch.manual_seed(0)  # the same initial weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    set_seed(0, device_specific=True)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    progress = Progress()
    acc.register_for_checkpointing(progress)

    native = a.out / "native"
    if a.native:
        folders = sorted(native.iterdir(), key=lambda f: int(f.name)) if native.is_dir() else []
        ref = str(folders[-1]) if folders else None
        if ref:
            acc.load_state(ref)
    else:
        ref = acc.resume()
        if ref is not None:
            acc.load_state(ref)
    print(f"rank {acc.process_index} resume from {ref} at batch {progress.batches}", flush=True)

    while progress.batches < TOTAL:
        for x, y in loader:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            progress.batches += 1
            progress.losses.append(loss.item())
            if progress.batches % EVERY == 0:
                if a.native:
                    acc.save_state(str(native / str(progress.batches)))
                else:
                    acc.save_state(step=progress.batches)
            if progress.batches == a.kill_at:
                if not a.native:
                    acc.checkpointer.wait()  # the saves so far committed: the resume is mid-epoch
                if dist.is_initialized():
                    dist.barrier()  # no rank dies before every rank's saves are done
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if progress.batches == TOTAL:
                break
    acc.end_training()  # through lastgood: returns once the last save committed
    moments = {f"opt.{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()
               if torch.is_tensor(v)}
    weights = {f"model.{k}": v for k, v in acc.unwrap_model(model).state_dict().items()}
    save_file({**weights, **moments, "losses": torch.tensor(progress.losses)},
              str(a.out / f"final-rank{acc.process_index}.safetensors"))
    print(f"rank {acc.process_index} done at batch {progress.batches}", flush=True)


if __name__ == "__main__":
    main()
