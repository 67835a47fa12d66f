"""Replicated state written once: which rank writes each replicated tensor, and where a
restore finds a tensor another rank wrote (docs/replicated.md).

Under DDP every rank holds the same weights and, since the gradients are all-reduced, the
same optimizer moments; written by every rank, a checkpoint of N ranks would store the
state N times and every rank upload all of it. So each such tensor is written by one rank, its
*owner*, and the other ranks' state documents name it instead of holding it:

    {"__replica__": "optimizer.state.model.0.weight.exp_avg", "rank": 2}

The rule, on purpose narrow (a tensor that is not truly identical on every rank would be
restored from one rank's copy, silently): the **parameters** of a module wrapped in
DistributedDataParallel over the whole world, except those DDP ignores and any of a DDP
with a communication hook other than plain all-reduce (Local SGD), and the per-parameter
state of a plain optimizer (not Local SGD's) over those parameters. Buffers (BatchNorm's
running statistics are updated by each rank's own batch), plain modules and tensors, schedulers, loaders, RNGs and `extra`
stay in each rank's own file. Before each save the ranks compare one fingerprint of the
names, dtypes and shapes they would share (two integer all-reduces); if any rank differs
(an optimizer that has not stepped everywhere, a ZeRO-sharded one), that save is written
in full by every rank. `Checkpointer(dedup=False)` or LASTGOOD_DEDUP=0 turns it off.

The owners are computed by every rank from the names, sizes and world size alone, without
communication, as DCP's dedup planner does: largest tensor first (ties by name), each to
the rank with the fewest bytes so far (ties: the lowest rank).

Restore: every rank's state document still lists every tensor, so a restoring rank finds
each `__replica__` in its owner's file through the manifest (that file's tensor index and
range digests), and reads it by verified ranges, or, for a file without range digests,
reads that whole file and checks its xxh3-128: every byte is verified. A
tensor its owner's file does not hold is a damaged checkpoint (CorruptCheckpoint), which
every rank falls back from.
"""

from __future__ import annotations

import hashlib
import logging

import torch
from torch import nn

from lastgood.state import distributed
from lastgood.errors import CorruptCheckpoint, Fenced
from lastgood.wire.format import REPLICA_REF as REF
from lastgood.wire.format import replica_refs
from lastgood.state.split import balance
from lastgood.state.buffers import array_from_buffer, tensor_from_buffer
from lastgood.state.trainstate import STATE_VERSION_REPLICAS, Captured

log = logging.getLogger("lastgood")
FENCED_BIT = 1 << 60  # save: in the fingerprint's all-reduce, "this rank is fenced"
GAP = 64 * 1024  # restore: bytes between two replicated tensors of one file read rather than asked for apart


# ------------------------------------------------------------------ save: who writes what
def shared_names(state, world_size: int) -> set[str]:
    """The stored names of the tensors the rule above calls replicated, for `state`
    (a TrainState) as capture() names them."""
    ddp = [(c, o) for c, o in state.components.items() if isinstance(o, nn.parallel.DistributedDataParallel)
           and state._kind(c) == "module" and _group_size(o) == world_size and _plain_hooks(o)]
    params: set[int] = set()
    out: set[str] = set()
    for cname, o in ddp:
        ignored = getattr(o, "parameters_to_ignore", ())  # DDP never syncs these: they may differ per rank
        for pname, p in o.module.named_parameters(remove_duplicate=False):  # a tied weight under each name
            if pname not in ignored:
                params.add(id(p))
                out.add(f"{cname}.{pname}")
    if not params:
        return out
    pnames = state._param_names()  # the names an optimizer's state is stored under
    for cname, o in state.components.items():
        if state._kind(cname) != "optimizer" or _local_sgd(o):
            continue
        for p in (p for g in o.param_groups for p in g["params"]):
            st = o.state.get(p) if id(p) in params else None
            for key, v in (st or {}).items():
                if isinstance(v, torch.Tensor) and isinstance(key, str) and id(p) in pnames:
                    out.add(f"{cname}.state.{pnames[id(p)]}.{key}")
    return out


def _plain_hooks(ddp) -> bool:
    """Does DDP still all-reduce every gradient into the same value on every rank? Not with
    a Python communication hook other than the plain allreduce / fp16 / bf16 ones: Local
    SGD's post_localSGD_hook, for one, averages the parameters only every few steps, so
    they and the optimizer's moments differ in between while names and shapes match. (The
    C++ built-in hooks, ALLREDUCE and FP16_COMPRESS, are plain all-reduces.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d

    plain = (d.allreduce_hook, d.fp16_compress_hook, d.bf16_compress_hook)
    return all(hook in plain for hook, _ in getattr(ddp, "_comm_hooks", ()))


def _local_sgd(opt) -> bool:
    """An optimizer that averages the parameters itself every few steps (Local SGD's
    PostLocalSGDOptimizer, or any wrapper holding a model averager): its state differs per rank."""
    from torch.distributed.algorithms.model_averaging.averagers import ModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    return isinstance(opt, PostLocalSGDOptimizer) or any(isinstance(v, ModelAverager) for v in vars(opt).values())


def _group_size(ddp) -> int:
    import torch.distributed as dist

    try:
        return dist.get_world_size(ddp.process_group)
    except Exception:  # noqa: BLE001 - not a group we can size: not shared with every rank
        return -1


def assign(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """name -> owner rank: largest first (ties by name), each to the least loaded rank
    (ties: the lowest). The same answer on every rank for the same names and sizes."""
    return balance(sizes, world_size)  # the rule a rank's files are balanced by too


def _fingerprint(tensors: dict, names) -> int:
    h = hashlib.sha256()
    for n in sorted(names):
        t = tensors[n]
        h.update(f"{n}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
    return int.from_bytes(h.digest()[:7], "little")  # fits the int64 of an all-reduce


def split(cap: Captured, state, rank: int, world_size: int, fenced: bool = False) -> Captured:
    """This rank's part of a captured state: the replicated tensors other ranks own are
    left out and named by reference. Collective (every rank calls it at every save, a
    fenced one too): `fenced`, this rank knows its launch is fenced; if any rank does,
    every rank raises Fenced here, at the same save, instead of some raising while the
    others wait in the all-reduce."""
    if world_size <= 1 or not distributed.initialized():
        return cap
    names = {n for n in shared_names(state, world_size) if isinstance(cap.tensors.get(n), torch.Tensor)}
    mine = _fingerprint(cap.tensors, names) if names else 0  # < 2**56: FENCED_BIT rides along
    top = distributed.all_max(mine | (FENCED_BIT if fenced else 0))
    if top & FENCED_BIT:
        raise Fenced(f"rank {rank}: a rank of this launch is fenced by a newer launch of the job; stop training")
    if top != distributed.all_min(mine):
        log.warning("lastgood: the ranks' replicated state differs in names or shapes: this save is written in "
                    "full by every rank")
        return cap
    if not names:
        return cap
    owner = assign({n: cap.tensors[n].numel() * cap.tensors[n].element_size() for n in names}, world_size)
    others = {n: r for n, r in owner.items() if r != rank}
    json_state = {**cap.json_state, "version": STATE_VERSION_REPLICAS,
                  "components": _refer(cap.json_state["components"], others)}
    return Captured(json_state, {n: t for n, t in cap.tensors.items() if n not in others})


def _refer(node, others: dict[str, int]):
    if isinstance(node, list):
        return [_refer(v, others) for v in node]
    if not isinstance(node, dict):
        return node
    name = node.get("__tensor__")
    if isinstance(name, str) and name in others:
        return {REF: name, "rank": others[name], **({"device": node["device"]} if "device" in node else {})}
    return {k: _refer(v, others) for k, v in node.items()}


# ------------------------------------------------------------------ restore: where it is
def needed(state: dict) -> dict[int, list[str]]:
    """owner rank -> the names a stored state document refers to in other ranks' files."""
    out: dict[int, list[str]] = {}
    for owner, name in replica_refs(state):
        if type(owner) is not int or not isinstance(name, str):  # checked before use as a key
            raise CorruptCheckpoint(f"a replicated tensor reference is malformed: "
                                    f"{str({REF: name, 'rank': owner})[:200]}")
        out.setdefault(owner, []).append(name)
    return out


def _check(cid, owner, names, world_size: int, held: dict | None) -> None:
    if type(owner) is not int or not 0 <= owner < world_size or not all(isinstance(n, str) for n in names):
        raise CorruptCheckpoint(f"checkpoint {cid}: a replicated tensor reference names rank {owner!r}'s file "
                                f"(of {world_size} ranks) and {str(names)[:200]}")
    if held is not None:
        lost = [n for n in names if not isinstance(n, str) or n not in held]
        if lost:
            raise CorruptCheckpoint(f"checkpoint {cid}: rank {owner}'s file does not hold the replicated "
                                    f"tensor(s) {lost[:3]} other ranks refer to")


def complete(transport, manifest, files: list, source: int) -> list:
    """Restore (checkpointer): give the source file the replicated tensors it names, from
    their owners' files: one read whole already (a restore at another world size without
    range digests reads every file), else read here (`_read`). The source file becomes a
    Joined; the other files are left as they are (the read plan's, or the whole files)."""
    from lastgood.state.sharding import StoredFile

    i, src = next((i, f) for i, f in enumerate(files) if f.rank == source)
    wanted = needed(src.state)
    if not wanted:
        return files
    by_rank = {f.rank: f for f in files if isinstance(f, StoredFile)}
    where = {}
    for owner, names in wanted.items():
        _check(manifest.checkpoint_id, owner, names, manifest.world_size, None)
        whole = by_rank.get(owner)
        if whole is not None and all(n in whole.tensors for n in names):
            where.update((n, whole) for n in names)
        else:
            got = _read(transport, manifest, owner, sorted(set(names)))
            where.update((n, got) for n in names)
    out = list(files)
    out[i] = Joined(src, where)
    return out


def _read(transport, manifest, rank: int, names: list[str]) -> "Fetched":
    """The named tensors of old rank `rank`, every byte verified. Which of the rank's files
    holds each (its first, or any it was split into) comes from each file's tensor index
    (its index object, checked against the root; or a monolithic manifest's own index):
    read by ranges checked against the file's range digests, or, for a file without
    them, the whole file, checked against its xxh3-128. A name none of them holds, or
    none at all, is a damaged checkpoint."""
    from lastgood.wire.manifest import IndexMismatch
    from lastgood.wire.ranges import RangeDigests
    from lastgood.restore.readplan import RangeReader

    cid, want = manifest.checkpoint_id, set(names)
    out = Fetched()
    for entry in manifest.files(rank):
        if not want:
            break
        try:
            if entry.tensors is None and entry.index is not None:
                entry = entry.with_index(rank, transport.index_bytes(cid, rank, entry.name))
        except IndexMismatch as e:
            raise CorruptCheckpoint(f"checkpoint {cid}: {e}") from None
        here = sorted(want & set(entry.tensors or ()))
        if not here:
            continue
        want -= set(here)
        if entry.digests is not None:
            reader, digests = RangeReader(transport, cid), RangeDigests(entry.data_start, entry.tensors, entry.digests)
            for lo, hi, group in _spans(entry.tensors, here, reader.window):
                buf = torch.empty(hi - lo, dtype=torch.uint8)  # uninitialised: every byte is read
                reader.read(rank, entry, digests, entry.data_start + lo, entry.data_start + hi, buf.numpy())
                for n in group:
                    out.add(n, buf.numpy(), entry.tensors[n], 0, -lo)
            continue
        buf = torch.empty(entry.size, dtype=torch.uint8)  # uninitialised: every byte is received
        data, got = transport.read_file(cid, rank, entry.name, entry.size, into=buf.numpy())
        if got != entry.xxh3_128:
            raise CorruptCheckpoint(f"checkpoint {cid} (step {manifest.step}) rank {rank} file {entry.name}: "
                                    f"xxh3-128 {got} does not match the committed {entry.xxh3_128}")
        for n in here:
            out.add(n, data, entry.tensors[n], entry.data_start, 0)
    if want:
        raise CorruptCheckpoint(f"checkpoint {cid}: rank {rank}'s files do not hold the replicated tensor(s) "
                                f"{sorted(want)[:3]} other ranks refer to")
    return out


def _spans(tensors: dict, names: list[str], window: int, gap: int = GAP) -> list[tuple[int, int, list[str]]]:
    """The named tensors' byte ranges (of the data section) as few requests: neighbours
    less than `gap` apart are read together, up to `window` bytes a request (one tensor
    larger than that is a request of its own). An owner's share lies mostly back to back
    (its per-rank tensors are few and small), so it is read in a few requests, not one per
    tensor; the gaps read are bounded by `gap` each."""
    out: list[tuple[int, int, list[str]]] = []
    for n in sorted(names, key=lambda n: tensors[n]["offsets"][0]):
        a, b = tensors[n]["offsets"]
        if out and a - out[-1][1] < gap and max(b, out[-1][1]) - out[-1][0] <= window:
            lo, hi, group = out[-1]
            out[-1] = (lo, max(hi, b), group + [n])
        else:
            out.append((a, b, [n]))
    return out


class Fetched:
    """Replicated tensors read from one owner's files: each a verified buffer and where in
    it the tensor lies; resolved as a stored file resolves its own (sharding.StoredFile)."""

    def __init__(self) -> None:
        self.tensors: dict[str, dict] = {}  # name -> {dtype, shape, data_offsets}, as a header has them
        self._bufs: dict[str, tuple[object, int]] = {}

    def add(self, name: str, buf, spec: dict, data_start: int, shift: int) -> None:
        a, b = spec["offsets"]
        self.tensors[name] = {"dtype": spec["dtype"], "shape": spec["shape"], "data_offsets": [a + shift, b + shift]}
        self._bufs[name] = (buf, data_start)

    def resolve(self, name: str, device: str | None, copy: bool) -> torch.Tensor:
        buf, start = self._bufs[name]
        return tensor_from_buffer(buf, self.tensors[name], start, device, copy=copy)

    def array(self, name: str):
        buf, start = self._bufs[name]
        return array_from_buffer(buf, self.tensors[name], start)


class Joined:
    """One rank's stored file plus the replicated tensors it names in other ranks' files:
    restore applies from it as from the file itself (tensors, resolve, array, state)."""

    def __init__(self, own, where: dict) -> None:
        self.own, self._where = own, where
        self.rank, self.state = own.rank, own.state
        self.tensors = {**own.tensors, **{n: f.tensors[n] for n, f in where.items()}}

    def resolve(self, name: str, device: str | None, copy: bool) -> torch.Tensor:
        return self._where.get(name, self.own).resolve(name, device, copy)

    def array(self, name: str):
        return self._where.get(name, self.own).array(name)

    def __getattr__(self, attr):  # piece, tensor, buf, start: the own file's
        return getattr(self.own, attr)
