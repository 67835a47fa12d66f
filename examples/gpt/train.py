"""Example trainer: a small GPT on CPU with DDP (gloo), written the way users write theirs.

    torchrun --nproc-per-node=2 examples/gpt/train.py --url http://127.0.0.1:8000 --run-name demo --out /tmp/out

Uses torch's own DistributedSampler with set_epoch every epoch and a StatefulDataLoader
with a worker process and no explicit generator (or, with --loader plain, a plain
DataLoader over lastgood.ResumableDistributedSampler). Nothing is seeded per epoch by
hand: lastgood's restore must make the resumed run bit-identical on its own.

Writes, per rank: losses-rank{R}.jsonl (step, exact loss, sample ids) and at the end
final-rank{R}.safetensors + final-rank{R}.json (parameters, optimizer state, RNG states).

Fault injection for tests: LASTGOOD_EXAMPLE_KILL="RANK:STEP:WHEN" makes RANK SIGKILL
itself at STEP, WHEN = after_save (right after save() returned, its upload in flight,
every earlier save committed) or after_step (after the optimizer step of a step without
a save, once the previous save has committed: a death between two saves).
LASTGOOD_EXAMPLE_PAUSE="STEP:DIR" makes every rank of the first launch stop before its save
of STEP (once the previous save has committed), write DIR/paused-rank{R} (its pid) and wait
for DIR/go; then it saves STEP and waits for that save: the test of fencing kills the
torchrun agent meanwhile and relaunches the job, and these ranks are its zombies.
LASTGOOD_EXAMPLE_GATE="STEP:PATH[,STEP:PATH...]" makes every rank, after STEP (and its
save), wait until the file PATH exists: a test outside the job (a service outage, say)
can line its events up with the job's steps.
LASTGOOD_EXAMPLE_HANG="RANK:STEP:PATH" makes RANK stop making progress inside STEP (after
the forward, before the backward's all-reduce, so the other ranks block in it) if the file
PATH exists; the rank deletes PATH first, so only one launch hangs (the supervisor's test).
LASTGOOD_EXAMPLE_SAVE_ONLY=1 leaves out `ckpt.step()`: a script that only saves, timed by its
saves alone (the supervisor's test of hang detection from save() alone).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lastgood  # noqa: E402
from model import GPT, GPTConfig, TokenWindows  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=os.environ.get("LASTGOOD_URL", "http://127.0.0.1:8000"))
    p.add_argument("--run-name", default=None,
                   help="the run; default LASTGOOD_RUN, else torchrun's --rdzv-id (TORCHELASTIC_RUN_ID)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=3, help="save after every N-th step")
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--loader", choices=["stateful", "plain"], default="stateful")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spike-guard", action="store_true", help="roll back automatically on a loss spike")
    p.add_argument("--spike-margin", type=int, default=0, help="trust only checkpoints this many steps before a spike")
    p.add_argument("--poison", default=None, metavar="EPOCH:ID",
                   help="in that epoch, sample ID reads corrupted (loss weight 1e4) and causes a loss spike")
    return p.parse_args(argv)


def fault_at(rank: int, step: int, when: str) -> bool:
    spec = os.environ.get("LASTGOOD_EXAMPLE_KILL")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return False  # under torchrun's elastic agent: only the first attempt dies
    r, s, w = spec.split(":")
    return int(r) == rank and int(s) == step and w == when


def pause_at(rank: int, step: int, ckpt) -> bool:
    """LASTGOOD_EXAMPLE_PAUSE (see the module docstring); True if this rank paused."""
    spec = os.environ.get("LASTGOOD_EXAMPLE_PAUSE")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return False
    at, gate = spec.split(":", 1)
    if int(at) != step:
        return False
    ckpt.wait()
    (Path(gate) / f"paused-rank{rank}").write_text(str(os.getpid()))
    print(f"[rank {rank}] paused before the save of step {step}", flush=True)
    while not (Path(gate) / "go").exists():
        time.sleep(0.05)
    return True


def wait_at_gate(step: int) -> None:
    spec = os.environ.get("LASTGOOD_EXAMPLE_GATE")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return
    for item in spec.split(","):
        s, path = item.split(":", 1)
        if int(s) == step:
            while not os.path.exists(path):
                time.sleep(0.05)


def hang_at(rank: int, step: int) -> None:
    """LASTGOOD_EXAMPLE_HANG (see the module docstring): never returns when it fires."""
    spec = os.environ.get("LASTGOOD_EXAMPLE_HANG")
    if not spec:
        return
    r, s, path = spec.split(":", 2)
    if int(r) != rank or int(s) != step:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return  # an earlier launch hung already
    print(f"[rank {rank}] fault injection: hanging in step {step}", flush=True)
    while True:
        time.sleep(1)


def die(rank: int, step: int, when: str) -> None:
    print(f"[rank {rank}] fault injection: SIGKILL at step {step} ({when})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def dump_final(out: Path, rank: int, model, opt, step: int, epoch: int) -> None:
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.module.state_dict().items()
               if k != "head.weight"}  # tied to tok.weight; safetensors refuses shared storage
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            tensors[f"opt.{i}.{k}"] = v.detach().clone()
    tensors["rng.torch"] = torch.get_rng_state()
    np_state = np.random.get_state()
    tensors["rng.numpy"] = torch.from_numpy(np_state[1].astype(np.int64))
    save_file(tensors, str(out / f"final-rank{rank}.safetensors"))
    meta = {"step": step, "epoch": epoch, "python_rng": list(random.getstate()[1]),
            "numpy_rng_pos": int(np_state[2]), "param_groups": opt.state_dict()["param_groups"]}
    (out / f"final-rank{rank}.json").write_text(json.dumps(meta))


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(args.seed)  # the usual one-time seeding; nothing more
    random.seed(args.seed)
    np.random.seed(args.seed)
    cfg = GPTConfig()
    model = DDP(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = 4

    def lr_lambda(s: int) -> float:  # linear warm-up, then cosine to 10 %
        if s < warmup:
            return (s + 1) / warmup
        t = (s - warmup) / max(1, args.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    data = TokenWindows(args.samples, cfg.ctx, cfg.vocab)
    if args.loader == "stateful":
        sampler = DistributedSampler(data, shuffle=True, seed=args.seed)
        loader = StatefulDataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers)
    else:
        sampler = lastgood.ResumableDistributedSampler(data, shuffle=True, seed=args.seed)
        loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers)

    poison_epoch, poison_id = map(int, args.poison.split(":")) if args.poison else (-1, -1)
    progress = {"epoch": 0}
    ckpt = lastgood.Checkpointer(args.url, run=args.run_name)
    state = lastgood.TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader, extra=progress)
    guard = (lastgood.SpikeGuard(ckpt, state, lr_factor=0.5, margin=args.spike_margin, min_history=4)
             if args.spike_guard else None)
    start = ckpt.restore(state)
    step = 0 if start is None else start + 1
    print(f"[rank {rank}] starting at step {step} (restored: {start})", flush=True)

    losses = open(out / f"losses-rank{rank}.jsonl", "a")
    save_only = os.environ.get("LASTGOOD_EXAMPLE_SAVE_ONLY") == "1"
    while step < args.steps:
        sampler.set_epoch(progress["epoch"])
        for ids, x, y in loader:
            model.train()
            weights = torch.where((ids == poison_id) & (progress["epoch"] == poison_epoch), 1e4, 1.0)
            loss = model(x, y, weights)
            hang_at(rank, step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if guard is not None and guard.observe(step, loss.item(), batch=ids.tolist()):
                losses.write(json.dumps({"step": step, "loss": loss.item().hex(), "ids": ids.tolist(),
                                         "epoch": progress["epoch"], "spike": True}) + "\n")
                step = guard.next_step  # back at the checkpoint before the spike
                break                   # re-enter the data loop: it continues after the spike
            opt.step()
            sched.step()
            losses.write(json.dumps({"step": step, "loss": loss.item().hex(), "ids": ids.tolist(),
                                     "epoch": progress["epoch"]}) + "\n")
            losses.flush()
            if not save_only:
                ckpt.step(step)  # progress for the heartbeats: a rank stuck in a step is seen hung (docs/health.md)
            if (step + 1) % args.every == 0:
                if fault_at(rank, step, "after_save"):
                    ckpt.wait()  # earlier saves committed; only this one will be in flight
                    ckpt.save(step, state)
                    die(rank, step, "after_save")
                paused = pause_at(rank, step, ckpt)
                ckpt.save(step, state)
                if paused:
                    ckpt.wait()  # a zombie hears that it is fenced here (lastgood.Fenced)
            elif fault_at(rank, step, "after_step"):
                ckpt.wait()  # a death between two saves: the previous one has committed
                die(rank, step, "after_step")
            wait_at_gate(step)
            step += 1
            if step >= args.steps:
                break
        else:
            progress["epoch"] += 1
    print(f"[rank {rank}] trained to step {step}; waiting for the saves", flush=True)
    ckpt.wait()
    print(f"[rank {rank}] saves: {json.dumps(ckpt.stats, sort_keys=True)}", flush=True)
    ckpt.close()
    dump_final(out, rank, model, opt, step, progress["epoch"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
