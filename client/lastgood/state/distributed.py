"""Rank, world size, launch identity and the few collectives restore needs.

Collectives use tensors only (broadcast/all_reduce of int64), never the object
collectives, which pickle.
"""

from __future__ import annotations

import os
import re
import secrets

import torch
import torch.distributed as dist

from lastgood.remote.config import ENV_ATTEMPT, ENV_NEW_RUN, ENV_RUN
from lastgood.errors import LastgoodError


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    if initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def local_world_size() -> int:
    """How many ranks of this job run on this host (torchrun's LOCAL_WORLD_SIZE; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_int(value: int, src: int = 0) -> int:
    if not initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.broadcast(t, src)
    return int(t.item())


def _all_reduce(value: int, op) -> int:
    if not initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=op)
    return int(t.item())


def all_min(value: int) -> int:
    return _all_reduce(value, dist.ReduceOp.MIN)


def all_max(value: int) -> int:
    return _all_reduce(value, dist.ReduceOp.MAX)


def all_gather_ints(values: list[int]) -> list[int]:
    """Every rank's list of ints, concatenated in rank order (tensors only, no pickle)."""
    if not initialized():
        return list(values)
    dev, world = _device(), dist.get_world_size()
    n = torch.tensor([len(values)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = max(int(x.item()) for x in sizes)
    mine = torch.full((max(longest, 1),), -1, dtype=torch.int64, device=dev)
    mine[: len(values)] = torch.tensor(values, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return [int(v) for p, k in zip(parts, sizes) for v in p[: int(k.item())].tolist()]


def elastic_run_id() -> str | None:
    """torchrun's run id (--rdzv-id) as a run name, when there is a meaningful one."""
    rid = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not rid or rid == "none":
        return None
    name = re.sub(r"[^A-Za-z0-9._-]", "-", rid).strip("-.")[:128].replace("..", "-")
    return name or None


# `torchrun --standalone` names its rendezvous with a fresh uuid4 on every launch
_RANDOM_RDZV_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def run_name(name: str | None, new_run: bool = False) -> str:
    """The run a Checkpointer saves to and restores from: `name` (run=, else LASTGOOD_RUN:
    config.ClientConfig.run), else torchrun's --rdzv-id. A run name that changes on every
    launch would make every relaunch a new run that silently starts from step 0, so a random
    standalone rendezvous id is refused unless a new run is asked for (new_run=True, or
    LASTGOOD_NEW_RUN=1)."""
    if name:
        return name
    name = elastic_run_id()
    if not name:
        raise LastgoodError(f"name the run: Checkpointer(url, run='my-run'), {ENV_RUN}=my-run, or run under "
                            "torchrun with --rdzv-id=my-run")
    if _RANDOM_RDZV_ID.match(os.environ.get("TORCHELASTIC_RUN_ID", "")) and not new_run:
        raise LastgoodError(
            f"the run name would be torchrun's rendezvous id {name}, which `torchrun --standalone` draws at "
            "random on every launch: a relaunch would find no checkpoint and start over from step 0. Name the run: "
            f"Checkpointer(url, run='my-run'), {ENV_RUN}=my-run, or torchrun --rdzv-id=my-run "
            "(--rdzv-backend=c10d --rdzv-endpoint=localhost:0 instead of --standalone); or set "
            f"{ENV_NEW_RUN}=1 to start a new run on purpose")
    return name


def launch_attempt(world_size: int, explicit: str | None = None) -> str:
    """One id shared by every rank of this launch of the job.

    Saves of the same step by a relaunched job must not collide with the abandoned
    attempt of the previous launch, so the id changes on every launch: `explicit`
    (attempt=, else LASTGOOD_ATTEMPT: config.ClientConfig.attempt); else drawn by rank 0 and
    broadcast when torch.distributed is up; else from torchrun's elastic run id and restart
    count.
    """
    if explicit:
        return explicit
    if initialized():
        return f"{broadcast_int(secrets.randbits(62)):016x}"
    if world_size == 1:
        return secrets.token_hex(8)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return f"{run_id}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"[:64]
    raise RuntimeError("several ranks but no torch.distributed process group and no torchrun run id: "
                       f"set {ENV_ATTEMPT} to one value per launch, the same on every rank")
