"""Rank, world size, launch identity and the few collectives restore needs.

Collectives use tensors only (broadcast/all_reduce of int64), never the object
collectives, which pickle.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from lastgood.remote.config import ENV_ATTEMPT, ENV_NEW_RUN, ENV_RUN
from lastgood.errors import LastgoodError


_alone = threading.local()


def initialized() -> bool:
    """Is there a process group that lastgood's collectives use? Not inside `alone()`."""
    return dist.is_available() and dist.is_initialized() and not getattr(_alone, "depth", 0)


@contextmanager
def alone():
    """This thread's lastgood calls make no collective call, as if there were no process
    group: a solo Checkpointer (one process saving state every rank holds alike) runs its
    calls inside it. The trainer's own collectives are untouched."""
    _alone.depth = getattr(_alone, "depth", 0) + 1
    try:
        yield
    finally:
        _alone.depth -= 1


_arrivals = 0  # how many collective Checkpointers this process has created: the Nth meets the Nth


def arrive(what: str, timeout: float, poll: float = 0.05) -> None:
    """Before the first collective call of `what`: wait until every rank of the group got
    here, else raise LastgoodError within `timeout` seconds, on every rank that did, instead
    of hanging in a collective the missing ranks never enter. Through the group's store
    (the rendezvous's key-value store), not a collective. Rank 0 decides "go" once all have
    arrived; a rank that waited in vain decides "fail" first; whichever decision is stored
    first (compare_set) holds for every rank, so a late rank fails too instead of entering
    a collective the others left."""
    global _arrivals
    if not initialized() or dist.get_world_size() <= 1:
        return
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a group without a store: nothing to check with
        return
    _arrivals += 1
    # a store that outlives a round of torchrun's restarts holds the older rounds' keys
    key = f"lastgood/arrive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_arrivals}"
    world, rank = dist.get_world_size(), dist.get_rank()
    store.add(f"{key}/count", 1)
    deadline = time.monotonic() + timeout
    verdict = b""
    while True:
        if rank == 0 and store.add(f"{key}/count", 0) >= world:
            verdict = store.compare_set(f"{key}/verdict", "", "go")
        elif store.check([f"{key}/verdict"]):
            verdict = store.get(f"{key}/verdict")
        if not verdict and time.monotonic() >= deadline:
            verdict = store.compare_set(f"{key}/verdict", "", "fail")
        if verdict:
            break
        time.sleep(poll)
    if verdict != b"go":
        arrived = store.add(f"{key}/count", 0)
        raise LastgoodError(
            f"{what}: not every rank created it within {timeout:g} s ({arrived} of {world} so far; "
            f"this is rank {rank}). "
            "It is collective: every rank creates it, at the same point of the program. For state that every "
            "rank holds alike (DDP) and that one rank saves, pass solo=True")


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
